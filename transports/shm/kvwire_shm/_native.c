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

static PyObject *py_copy(PyObject *self, PyObject *args)
{
    PyObject *od, *os_, *ol;
    long long nt_from;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOL", &od, &os_, &ol, &nt_from))
        return NULL;
    Py_buffer v[3];
    Py_ssize_t n;
    if (get_three(od, os_, ol, v, &n) < 0)
        return NULL;
    copy_job job = {v[0].buf, v[1].buf, v[2].buf, 0, n, 0, -1, nt_from};
    for (Py_ssize_t i = 0; i < n; i++) {
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
    (void)self;
    if (!PyArg_ParseTuple(args, "iOOOp", &pid, &ol, &or_, &on, &write))
        return NULL;
    Py_buffer v[3];
    Py_ssize_t n;
    if (get_three(ol, or_, on, v, &n) < 0)
        return NULL;
    cma_job job = {(pid_t)pid, write, v[0].buf, v[1].buf, v[2].buf, 0, n, 0};
    for (Py_ssize_t i = 0; i < n; i++) {
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

static PyMethodDef methods[] = {
    {"copy", py_copy, METH_VARARGS,
     "copy(dst, src, length, nt_from): memmove(dst[i], src[i], length[i]) for every i (int64 "
     "arrays or lists), streaming stores for spans of nt_from bytes or more (-1: never), GIL "
     "released."},
    {"cma", py_cma, METH_VARARGS,
     "cma(pid, local, remote, length, write) -> errno: process_vm_readv (or writev) of every "
     "span, IOV_MAX per call, short counts resumed, GIL released; 0 when every byte moved, -1 "
     "when a call moved nothing."},
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
