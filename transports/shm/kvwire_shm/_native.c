/* Native copies for the shm transport: scattered spans between two mappings of this
 * process (non-temporal stores for long spans)
 * and batched cross-memory attach (process_vm_readv/writev), both with the GIL released, so
 * two threads (the worker and a caller waiting, see _executor.py) can copy at once.
 *
 * Why C: Python cannot choose how bytes are stored. glibc's memmove keeps every byte in
 * the cache up to a threshold of several MiB, so a transfer of many 64 KiB spans that the
 * reader will not touch soon evicts the cache twice over; streaming stores write around
 * it and move about 1.6x the bytes per second here (see docs/benchmarks.md). A call per
 * span through ctypes also costs ~0.3 us of interpreter per span.
 *
 * The module is optional: kvwire_shm falls back to its pure-Python paths without it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/types.h>
#include <sys/uio.h>

#if defined(__x86_64__) || defined(__i386__)
#include <emmintrin.h>
#define KV_HAVE_NT 1
#else
#define KV_HAVE_NT 0
#endif

#define KV_IOV_MAX 1024

/* -- copies inside this address space ------------------------------------------------ */

#if KV_HAVE_NT
/* memmove that writes the bulk with streaming stores (no read-for-ownership, no cache
 * fill); the unaligned head and the tail go through memcpy. Never for overlapping spans. */
static void nt_copy(char *dst, const char *src, size_t n)
{
    size_t head = (size_t)(-(uintptr_t)dst) & 15u;
    if (head > n)
        head = n;
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    size_t bulk = n & ~(size_t)63;
    for (size_t i = 0; i < bulk; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    memcpy(dst + bulk, src + bulk, n - bulk);
}
#endif

typedef struct {
    const int64_t *dst, *src, *len;
    Py_ssize_t first, last;   /* spans [first, last) */
    int64_t skip, stop;       /* bytes of span `first` to skip; bytes of `last - 1` to copy (-1: all) */
    int64_t nt_from;
} copy_job;

static void copy_one(char *d, const char *s, size_t n, int64_t nt_from)
{
#if KV_HAVE_NT
    if (nt_from >= 0 && (int64_t)n >= nt_from && (d + n <= s || s + n <= d)) {
        nt_copy(d, s, n);
        return;
    }
#else
    (void)nt_from;
#endif
    memmove(d, s, n);
}

static void *copy_run(void *arg)
{
    const copy_job *job = arg;
    for (Py_ssize_t i = job->first; i < job->last; i++) {
        int64_t from = (i == job->first) ? job->skip : 0;
        int64_t to = (i == job->last - 1 && job->stop >= 0) ? job->stop : job->len[i];
        if (to > from)
            copy_one((char *)(intptr_t)(job->dst[i] + from), (const char *)(intptr_t)(job->src[i] + from),
                     (size_t)(to - from), job->nt_from);
    }
#if KV_HAVE_NT
    _mm_sfence();  /* streaming stores are weakly ordered: visible before we report done */
#endif
    return NULL;
}

static int get_i64(PyObject *obj, Py_buffer *view, const char *what)
{
    if (PyList_Check(obj) || PyTuple_Check(obj)) {
        Py_ssize_t n = PySequence_Fast_GET_SIZE(obj);
        PyObject *bytes = PyBytes_FromStringAndSize(NULL, n * 8);
        if (bytes == NULL)
            return -1;
        int64_t *out = (int64_t *)PyBytes_AS_STRING(bytes);
        PyObject **items = PySequence_Fast_ITEMS(obj);
        for (Py_ssize_t i = 0; i < n; i++) {
            out[i] = PyLong_AsLongLong(items[i]);
            if (out[i] == -1 && PyErr_Occurred()) {
                Py_DECREF(bytes);
                return -1;
            }
        }
        int rc = PyBuffer_FillInfo(view, bytes, out, n * 8, 1, PyBUF_SIMPLE);
        Py_DECREF(bytes);  /* the view holds its own reference */
        if (rc == 0) {
            view->itemsize = 8;
            view->format = (char *)"q";
        }
        return rc;
    }
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    if (view->itemsize != 8 || view->format == NULL || (strcmp(view->format, "q") && strcmp(view->format, "l")
                                                         && strcmp(view->format, "<q") && strcmp(view->format, "<l"))) {
        PyErr_Format(PyExc_TypeError, "%s: expected a contiguous int64 array", what);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static int get_three(PyObject *a, PyObject *b, PyObject *c, Py_buffer v[3], Py_ssize_t *n)
{
    if (get_i64(a, &v[0], "first array") < 0)
        return -1;
    if (get_i64(b, &v[1], "second array") < 0) {
        PyBuffer_Release(&v[0]);
        return -1;
    }
    if (get_i64(c, &v[2], "lengths") < 0) {
        PyBuffer_Release(&v[0]);
        PyBuffer_Release(&v[1]);
        return -1;
    }
    *n = v[2].len / 8;
    if (v[0].len / 8 != *n || v[1].len / 8 != *n) {
        PyErr_SetString(PyExc_ValueError, "arrays of different lengths");
        for (int k = 0; k < 3; k++)
            PyBuffer_Release(&v[k]);
        return -1;
    }
    return 0;
}

/* [first, last) of n spans, last < 0 meaning n: a chunk of a larger plan, named without
 * slicing the arrays in Python. */
static int span_range(Py_ssize_t n, Py_ssize_t *first, Py_ssize_t *last, Py_buffer v[3])
{
    if (*last < 0)
        *last = n;
    if (*first < 0 || *first > *last || *last > n) {
        for (int k = 0; k < 3; k++)
            PyBuffer_Release(&v[k]);
        PyErr_SetString(PyExc_ValueError, "span range outside the arrays");
        return -1;
    }
    return 0;
}

static PyObject *py_copy(PyObject *self, PyObject *args)
{
    PyObject *od, *os_, *ol;
    long long nt_from;
    Py_ssize_t first = 0, last = -1;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOL|nn", &od, &os_, &ol, &nt_from, &first, &last))
        return NULL;
    Py_buffer v[3];
    Py_ssize_t n;
    if (get_three(od, os_, ol, v, &n) < 0 || span_range(n, &first, &last, v) < 0)
        return NULL;
    copy_job job = {v[0].buf, v[1].buf, v[2].buf, first, last, 0, -1, nt_from};
    for (Py_ssize_t i = first; i < last; i++) {
        if (job.len[i] < 0) {
            for (int k = 0; k < 3; k++)
                PyBuffer_Release(&v[k]);
            PyErr_SetString(PyExc_ValueError, "negative length");
            return NULL;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    copy_run(&job);
    Py_END_ALLOW_THREADS
    for (int k = 0; k < 3; k++)
        PyBuffer_Release(&v[k]);
    Py_RETURN_NONE;
}

/* -- cross-memory attach ---------------------------------------------------------------- */

typedef struct {
    pid_t pid;
    int write;
    const int64_t *local, *remote, *len;
    Py_ssize_t first, last;
    int error;      /* errno of a failed call; -1: a call moved nothing */
} cma_job;

static void *cma_run(void *arg)
{
    cma_job *job = arg;
    struct iovec lv[KV_IOV_MAX], rv[KV_IOV_MAX];
    Py_ssize_t i = job->first;
    int64_t into = 0;  /* bytes of span i already moved */
    job->error = 0;
    while (i < job->last) {
        Py_ssize_t k = 0;
        ssize_t want = 0;
        for (Py_ssize_t j = i; j < job->last && k < KV_IOV_MAX; j++, k++) {
            int64_t off = (j == i) ? into : 0;
            lv[k].iov_base = (void *)(intptr_t)(job->local[j] + off);
            rv[k].iov_base = (void *)(intptr_t)(job->remote[j] + off);
            lv[k].iov_len = rv[k].iov_len = (size_t)(job->len[j] - off);
            want += (ssize_t)lv[k].iov_len;
        }
        ssize_t got = job->write ? process_vm_writev(job->pid, lv, (unsigned long)k, rv, (unsigned long)k, 0)
                                 : process_vm_readv(job->pid, lv, (unsigned long)k, rv, (unsigned long)k, 0);
        if (got < 0) {
            job->error = errno ? errno : EIO;
            return NULL;
        }
        if (got == 0 && want > 0) {
            job->error = -1;
            return NULL;
        }
        /* Skip what completed; a short count resumes inside the span it stopped in. */
        while (got > 0) {
            int64_t rest = job->len[i] - into;
            if (got >= rest) {
                got -= rest;
                i++;
                into = 0;
            } else {
                into += got;
                got = 0;
            }
        }
        while (i < job->last && job->len[i] == 0)
            i++;
    }
    return NULL;
}

static PyObject *py_cma(PyObject *self, PyObject *args)
{
    int pid, write;
    PyObject *ol, *or_, *on;
    Py_ssize_t first = 0, last = -1;
    (void)self;
    if (!PyArg_ParseTuple(args, "iOOOp|nn", &pid, &ol, &or_, &on, &write, &first, &last))
        return NULL;
    Py_buffer v[3];
    Py_ssize_t n;
    if (get_three(ol, or_, on, v, &n) < 0 || span_range(n, &first, &last, v) < 0)
        return NULL;
    cma_job job = {(pid_t)pid, write, v[0].buf, v[1].buf, v[2].buf, first, last, 0};
    for (Py_ssize_t i = first; i < last; i++) {
        if (job.len[i] < 0) {
            for (int k = 0; k < 3; k++)
                PyBuffer_Release(&v[k]);
            PyErr_SetString(PyExc_ValueError, "negative length");
            return NULL;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    cma_run(&job);
    Py_END_ALLOW_THREADS
    for (int k = 0; k < 3; k++)
        PyBuffer_Release(&v[k]);
    return PyLong_FromLong(job.error);
}

/* -- planning a host transfer ----------------------------------------------------------- */

/* int64 sums and differences as numpy computes them (wrapping), without C's undefined
 * behaviour on overflow: absurd addresses must plan exactly as the Python path plans them. */
static int64_t wrap_add(int64_t a, int64_t b)
{
    return (int64_t)((uint64_t)a + (uint64_t)b);
}

static int64_t wrap_gap(int64_t a, int64_t b)  /* np.abs(a - b): 2^63 apart reads negative */
{
    int64_t d = (int64_t)((uint64_t)a - (uint64_t)b);
    return d < 0 ? (int64_t)(0 - (uint64_t)d) : d;
}

/* Index of the region holding [addr, addr + len), or -1 (regions sorted by start). */
static Py_ssize_t locate(const int64_t *starts, const int64_t *ends, Py_ssize_t regions, int64_t addr,
                         int64_t len)
{
    Py_ssize_t lo = 0, hi = regions;  /* first start > addr, as bisect_right */
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        if (starts[mid] <= addr)
            lo = mid + 1;
        else
            hi = mid;
    }
    Py_ssize_t i = lo - 1;
    return (i >= 0 && ends[i] - addr >= len) ? i : -1;
}

static int get_table(PyObject *obj, Py_buffer *view, Py_ssize_t want, const char *what)
{
    if (get_i64(obj, view, what) < 0)
        return -1;
    if (want >= 0 && view->len / 8 != want) {
        PyErr_Format(PyExc_ValueError, "%s: wrong length", what);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* plan(local, remote, lstarts, lends, rstarts, rends, rdeltas, mapped, write, chunk, most)
 *
 * The whole plan of a transfer between host memory here and one kind of host memory of the
 * peer, in one pass: every descriptor checked and located as Table.locate does, addresses
 * translated and ordered as _plan does, neighbours merged (coalesce_columns), long spans cut
 * (split_long) and the spans grouped into chunks (group_bounds). Returns None when any
 * descriptor is not plainly valid, so that the Python path finds and words the error; it
 * never accepts what that path refuses. */
static PyObject *py_plan(PyObject *self, PyObject *args)
{
    PyObject *ol, *or_, *ols, *ole, *ors, *ore, *ord;
    int mapped, write;
    long long chunk, most;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOOOOOppLL", &ol, &or_, &ols, &ole, &ors, &ore, &ord, &mapped, &write,
                          &chunk, &most))
        return NULL;
    if (chunk <= 0 || most <= 0) {
        PyErr_SetString(PyExc_ValueError, "chunk and most must be positive");
        return NULL;
    }
    Py_buffer v[7];
    int held = 0;
    PyObject *result = NULL, *bounds = NULL;
    int64_t *scratch = NULL;
    PyObject *arrays[7] = {ol, or_, ols, ole, ors, ore, ord};
    static const char *names[7] = {"local", "remote", "local starts", "local ends",
                                   "remote starts", "remote ends", "remote deltas"};
    for (; held < 7; held++) {
        /* remote as long as local; each table's columns as long as its starts */
        Py_ssize_t want = held == 1 ? v[0].len / 8 : held == 3 ? v[2].len / 8 : held >= 5 ? v[4].len / 8 : -1;
        if (get_table(arrays[held], &v[held], want, names[held]) < 0)
            goto done;
    }
    if (v[0].len % 24) {
        PyErr_SetString(PyExc_ValueError, "descriptors must be rows of three int64");
        goto done;
    }
    const int64_t *local = v[0].buf, *remote = v[1].buf;
    const int64_t *lstarts = v[2].buf, *lends = v[3].buf, *rstarts = v[4].buf, *rends = v[5].buf;
    const int64_t *rdeltas = v[6].buf;
    Py_ssize_t rows = v[0].len / 24, lregions = v[2].len / 8, rregions = v[4].len / 8;

    /* Pass 1: check, translate and merge into `scratch` (three columns of `rows`). */
    scratch = PyMem_Malloc(rows * 24 + 1);
    if (scratch == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    int64_t *dst = scratch, *src = dst + rows, *len = src + rows;
    Py_ssize_t m = 0, pieces = 0;
    int64_t total = 0;
    for (Py_ssize_t i = 0; i < rows; i++) {
        int64_t la = local[3 * i], n = local[3 * i + 1], ra = remote[3 * i];
        if (la < 0 || n < 0 || ra < 0 || remote[3 * i + 1] != n)
            goto invalid;
        Py_ssize_t li = locate(lstarts, lends, lregions, la, n);
        Py_ssize_t ri = locate(rstarts, rends, rregions, ra, n);
        if (li < 0 || ri < 0)
            goto invalid;
        if (n == 0)
            continue;
        if (n > INT64_MAX - total)  /* more bytes than int64 counts: the Python path's call */
            goto invalid;
        total += n;
        int64_t d = la, s = ra;  /* CMA keeps (local, remote) order; the flag says which way */
        if (mapped) {
            int64_t here = wrap_add(ra, rdeltas[ri]);
            d = write ? here : la;
            s = write ? la : here;
        }
        if (m > 0 && wrap_add(dst[m - 1], len[m - 1]) == d && wrap_add(src[m - 1], len[m - 1]) == s) {
            len[m - 1] += n;  /* at most `total`: no overflow */
        } else {
            dst[m] = d;
            src[m] = s;
            len[m] = n;
            m++;
        }
    }
    /* Pass 2: count the pieces once long spans are cut (not a span whose ends overlap in
     * one address space: memmove copies it as a unit). Too many to list: the Python path's
     * call (it fails the transfer). */
    for (Py_ssize_t j = 0; j < m; j++) {
        int cut = len[j] > chunk && (!mapped || wrap_gap(dst[j], src[j]) >= len[j]);
        int64_t these = cut ? len[j] / chunk + (len[j] % chunk != 0) : 1;
        if (these > PY_SSIZE_T_MAX / 24 - pieces)
            goto invalid;
        pieces += (Py_ssize_t)these;
    }
    PyObject *spans = PyBytes_FromStringAndSize(NULL, pieces * 24);  /* filled before shared */
    if (spans == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_MemoryError))
            goto done;
        PyErr_Clear();  /* too large to plan here: the Python path's call, as above */
        goto invalid;
    }
    bounds = PyList_New(0);
    if (bounds == NULL) {
        Py_DECREF(spans);
        goto done;
    }
    int64_t *pd = (int64_t *)PyBytes_AS_STRING(spans), *ps = pd + pieces, *pl = ps + pieces;
    Py_ssize_t k = 0;
    for (Py_ssize_t j = 0; j < m; j++) {
        int cut = len[j] > chunk && (!mapped || wrap_gap(dst[j], src[j]) >= len[j]);
        int64_t step = cut ? chunk : len[j];
        for (int64_t off = 0; off < len[j]; off += (len[j] - off > step ? step : len[j] - off)) {
            pd[k] = wrap_add(dst[j], off);
            ps[k] = wrap_add(src[j], off);
            pl[k] = len[j] - off > step ? step : len[j] - off;
            k++;
        }
    }
    /* Pass 3: chunks of about `chunk` bytes and at most `most` spans; a span never splits. */
    Py_ssize_t first = 0;
    while (1) {
        PyObject *at = PyLong_FromSsize_t(first);
        if (at == NULL || PyList_Append(bounds, at) < 0) {
            Py_XDECREF(at);
            Py_DECREF(spans);
            goto done;
        }
        Py_DECREF(at);
        if (first >= pieces)
            break;
        Py_ssize_t stop = first;
        int64_t bytes = 0;
        while (stop < pieces && stop - first < most && (stop == first || pl[stop] <= chunk - bytes)) {
            bytes += pl[stop];
            stop++;
        }
        first = stop;
    }
    result = Py_BuildValue("(NOLn)", spans, bounds, (long long)total, m);
    goto done;
invalid:
    result = Py_None;
    Py_INCREF(result);
done:
    PyMem_Free(scratch);
    Py_XDECREF(bounds);
    for (int h = 0; h < held; h++)
        PyBuffer_Release(&v[h]);
    return result;
}

static PyMethodDef methods[] = {
    {"copy", py_copy, METH_VARARGS,
     "copy(dst, src, length, nt_from, first=0, last=-1): memmove(dst[i], src[i], length[i]) "
     "for every i in [first, last) (int64 arrays or lists; last -1: to the end), streaming "
     "stores for spans of nt_from bytes or more (-1: never), GIL released."},
    {"cma", py_cma, METH_VARARGS,
     "cma(pid, local, remote, length, write, first=0, last=-1) -> errno: process_vm_readv "
     "(or writev) of every span in [first, last), IOV_MAX per call, short counts resumed, GIL "
     "released; 0 when every byte moved, -1 when a call moved nothing."},
    {"plan", py_plan, METH_VARARGS,
     "plan(local, remote, lstarts, lends, rstarts, rends, rdeltas, mapped, write, chunk, most) -> "
     "(spans, bounds, total, merged) or None: a host transfer checked, merged, cut and grouped "
     "in one pass; spans is three int64 columns (dst, src, length), bounds where each chunk "
     "starts, then the span count; None when a descriptor is not plainly valid."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvwire_shm._native", NULL, -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__native(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "HAVE_NT", KV_HAVE_NT) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
