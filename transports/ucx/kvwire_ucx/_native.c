/* Native post/progress loop for the ucx transport.
 *
 * Why C: UCP has no multi-element get for host memory, so a transfer of N rows is N calls
 * of ucp_get_nbx (or ucp_put_nbx). Through ctypes each costs about a microsecond of
 * argument conversion before UCX runs; here one call posts every row, then progresses the
 * worker until every request finished or a deadline passed, with the GIL released.
 *
 * No UCX header or library is needed to build this: the adapter hands over the addresses
 * of the libucp functions it already bound with ctypes (one UCX, the wheel's), and only
 * pointers and integers cross (ucp_request_param_t stays the ctypes structure). The module
 * is optional: kvwire_ucx falls back to its ctypes loop without it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef void *(*rma_fn)(void *ep, void *buffer, size_t count, uint64_t remote_addr, void *rkey,
                        const void *param);
typedef void (*free_fn)(void *request);
typedef unsigned (*progress_fn)(void *worker);
typedef int8_t (*check_fn)(void *request);

#define UCS_INPROGRESS 1
#define ERR_PTR_MIN ((uintptr_t)-100)

static int64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* `obj` (an int64/uint64 buffer or a sequence of ints) as n uint64 in `out` (malloc'd). */
static int load(PyObject *obj, Py_ssize_t *n, uint64_t **out)
{
    Py_buffer view;
    if (PyObject_CheckBuffer(obj) && PyObject_GetBuffer(obj, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) == 0) {
        if (view.itemsize != 8 || view.format == NULL || strchr("qQlL", view.format[strlen(view.format) - 1]) == NULL) {
            PyBuffer_Release(&view);
            PyErr_SetString(PyExc_TypeError, "expected a contiguous 64-bit integer array");
            return -1;
        }
        Py_ssize_t count = view.len / 8;
        if (*n >= 0 && count != *n) {
            PyBuffer_Release(&view);
            PyErr_SetString(PyExc_ValueError, "arrays of different lengths");
            return -1;
        }
        *n = count;
        *out = malloc((size_t)(count ? count : 1) * 8);
        if (*out == NULL) {
            PyBuffer_Release(&view);
            PyErr_NoMemory();
            return -1;
        }
        memcpy(*out, view.buf, (size_t)count * 8);
        PyBuffer_Release(&view);
        return 0;
    }
    PyErr_Clear();
    PyObject *seq = PySequence_Fast(obj, "expected a sequence of ints or an int64 array");
    if (seq == NULL)
        return -1;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    if (*n >= 0 && count != *n) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "arrays of different lengths");
        return -1;
    }
    *n = count;
    *out = malloc((size_t)(count ? count : 1) * 8);
    if (*out == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < count; i++) {
        (*out)[i] = (uint64_t)PyLong_AsUnsignedLongLongMask(items[i]);
        if (PyErr_Occurred()) {
            Py_DECREF(seq);
            free(*out);
            return -1;
        }
    }
    Py_DECREF(seq);
    return 0;
}

/* rma(functions, worker, ep, local, length, remote, rkey, param, wait_ns)
 *     -> (running, status, row)
 *
 * functions: (ucp_get_nbx or ucp_put_nbx, ucp_request_free, ucp_worker_progress,
 * ucp_request_check_status) as addresses. Posts one call per row; a request UCX hands back
 * is kept and the worker progressed until all are complete or wait_ns passed (0: no
 * progress at all, only the posts). Requests still running then are released to finish
 * on their own (a flush sees them through). `running`: rows not known complete; status:
 * 0, or the negative UCS status of the first failure (a post, or a request's completion),
 * with `row` its index (-1 if none). Posting stops at a post that fails.
 */
static PyObject *py_rma(PyObject *self, PyObject *args)
{
    unsigned long long f_rma, f_free, f_progress, f_check, worker, ep;
    PyObject *objs[5];
    long long wait_ns;
    (void)self;
    if (!PyArg_ParseTuple(args, "(KKKK)KKOOOOOL", &f_rma, &f_free, &f_progress, &f_check, &worker, &ep,
                          &objs[0], &objs[1], &objs[2], &objs[3], &objs[4], &wait_ns))
        return NULL;
    if (!f_rma || !f_free || !f_progress || !f_check || !ep) {
        PyErr_SetString(PyExc_ValueError, "null function or endpoint");
        return NULL;
    }
    uint64_t *cols[5] = {NULL, NULL, NULL, NULL, NULL};
    Py_ssize_t n = -1;
    for (int k = 0; k < 5; k++) {
        if (load(objs[k], &n, &cols[k]) < 0) {
            for (int j = 0; j < k; j++)
                free(cols[j]);
            return NULL;
        }
    }
    void **reqs = malloc((size_t)(n ? n : 1) * sizeof(void *));
    Py_ssize_t *rows = malloc((size_t)(n ? n : 1) * sizeof(Py_ssize_t));
    if (reqs == NULL || rows == NULL) {
        free(reqs);
        free(rows);
        for (int k = 0; k < 5; k++)
            free(cols[k]);
        return PyErr_NoMemory();
    }
    rma_fn rma = (rma_fn)(uintptr_t)f_rma;
    free_fn release = (free_fn)(uintptr_t)f_free;
    progress_fn progress = (progress_fn)(uintptr_t)f_progress;
    check_fn check = (check_fn)(uintptr_t)f_check;
    Py_ssize_t pending = 0, failed_row = -1;
    int status = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        if (cols[1][i] == 0)
            continue;
        void *req = rma((void *)(uintptr_t)ep, (void *)(uintptr_t)cols[0][i], (size_t)cols[1][i], cols[2][i],
                        (void *)(uintptr_t)cols[3][i], (const void *)(uintptr_t)cols[4][i]);
        if (req == NULL)
            continue;
        if ((uintptr_t)req >= ERR_PTR_MIN) {
            status = (int)(intptr_t)req;
            failed_row = i;
            break;
        }
        reqs[pending] = req;
        rows[pending++] = i;
    }
    if (pending && wait_ns > 0 && status == 0) {
        int64_t deadline = now_ns() + wait_ns;
        Py_ssize_t first = 0;  /* requests before `first` are complete and freed */
        for (;;) {
            while (first < pending) {
                int8_t s = check(reqs[first]);
                if (s == UCS_INPROGRESS)
                    break;
                release(reqs[first]);
                if (s < 0 && status == 0) {
                    status = s;
                    failed_row = rows[first];
                }
                first++;
            }
            if (first == pending || now_ns() >= deadline)
                break;
            progress((void *)(uintptr_t)worker);
        }
        memmove(reqs, reqs + first, (size_t)(pending - first) * sizeof(void *));
        pending -= first;
    }
    for (Py_ssize_t i = 0; i < pending; i++)
        release(reqs[i]);  /* still running: UCX finishes and frees them itself */
    Py_END_ALLOW_THREADS
    free(reqs);
    free(rows);
    for (int k = 0; k < 5; k++)
        free(cols[k]);
    return Py_BuildValue("(nin)", pending, status, failed_row);
}

static PyMethodDef methods[] = {
    {"rma", py_rma, METH_VARARGS,
     "rma((rma, free, progress, check_status), worker, ep, local, length, remote, rkey, param, "
     "wait_ns) -> (running, status, row): post every row, progress until done or wait_ns."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvwire_ucx._native", NULL, -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
