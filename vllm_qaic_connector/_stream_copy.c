/* Copies of many byte ranges, and of strided blocks, with non-temporal stores.
 *
 * A KV handoff writes whole blocks that the decode reads at its next step, not now, so
 * caching the destination only costs bandwidth: an ordinary copy first reads every
 * destination line it writes. Streaming stores skip that read, and walking four ranges
 * at once keeps more loads in flight; together they copy shuffled 32 KiB-256 KiB blocks
 * about 1.5x faster than memcpy per block (see `python -m vllm_qaic_connector.bench`).
 * Without SSE2 this is memcpy per range.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define WAYS 4
#define STEP 4096 /* bytes of each range per turn: one page */

#if defined(__SSE2__)
/* Streams [off, end) of one range; the caller keeps dst + off 16-byte aligned. */
static void stream_part(char *dst, const char *src, size_t off, size_t end) {
    for (; off + 64 <= end; off += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + off));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + off + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + off + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + off + 48));
        _mm_stream_si128((__m128i *)(dst + off), a);
        _mm_stream_si128((__m128i *)(dst + off + 16), b);
        _mm_stream_si128((__m128i *)(dst + off + 32), c);
        _mm_stream_si128((__m128i *)(dst + off + 48), d);
    }
    if (off < end) memcpy(dst + off, src + off, end - off);
}

/* One range: memcpy up to the first 16-byte aligned destination byte, stream the rest. */
static size_t aligned_head(const char *dst, size_t len) {
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    return head < len ? head : len;
}

static void copy_group(const uint64_t *dst_at, const uint64_t *src_at, const uint64_t *len, size_t n) {
    char *dst[WAYS];
    const char *src[WAYS];
    size_t head[WAYS], longest = 0;
    for (size_t w = 0; w < n; w++) {
        dst[w] = (char *)(uintptr_t)dst_at[w];
        src[w] = (const char *)(uintptr_t)src_at[w];
        head[w] = aligned_head(dst[w], len[w]);
        memcpy(dst[w], src[w], head[w]);
        if (len[w] > longest) longest = len[w];
    }
    /* turn k streams [head + k * STEP, head + (k + 1) * STEP) of every range: aligned */
    for (size_t off = 0; off < longest; off += STEP) {
        for (size_t w = 0; w < n; w++) {
            size_t start = head[w] + off;
            size_t end = start + STEP < len[w] ? start + STEP : len[w];
            if (start < end) stream_part(dst[w], src[w], start, end);
        }
    }
}
#endif

static void copy_ranges(const uint64_t *dst, const uint64_t *src, const uint64_t *len, size_t n) {
#if defined(__SSE2__)
    for (size_t i = 0; i < n; i += WAYS) {
        size_t k = n - i < WAYS ? n - i : WAYS;
        copy_group(dst + i, src + i, len + i, k);
    }
    _mm_sfence(); /* streamed stores are weakly ordered: visible before we return */
#else
    for (size_t i = 0; i < n; i++) memcpy((void *)(uintptr_t)dst[i], (const void *)(uintptr_t)src[i], len[i]);
#endif
}

/* Block i's rows: rows[a][b] of `chunk` bytes at base + a * stride_a + b * stride_b. */
typedef struct {
    Py_ssize_t rows_a, rows_b, chunk, dst_a, dst_b, src_a, src_b;
} rows_t;

static void copy_blocks(const uint64_t *dst, const uint64_t *src, size_t n, const rows_t *r) {
    for (size_t i = 0; i < n; i++) {
        for (Py_ssize_t a = 0; a < r->rows_a; a++) {
            for (Py_ssize_t b = 0; b < r->rows_b; b++) {
                char *d = (char *)(uintptr_t)dst[i] + a * r->dst_a + b * r->dst_b;
                const char *s = (const char *)(uintptr_t)src[i] + a * r->src_a + b * r->src_b;
#if defined(__SSE2__)
                size_t head = aligned_head(d, (size_t)r->chunk);
                memcpy(d, s, head);
                stream_part(d, s, head, (size_t)r->chunk);
#else
                memcpy(d, s, (size_t)r->chunk);
#endif
            }
        }
    }
#if defined(__SSE2__)
    _mm_sfence();
#endif
}

static PyObject *py_copy_blocks(PyObject *self, PyObject *args) {
    Py_buffer dst, src;
    rows_t r;
    if (!PyArg_ParseTuple(args, "y*y*nnnnnnn", &dst, &src, &r.rows_a, &r.rows_b, &r.chunk,
                          &r.dst_a, &r.dst_b, &r.src_a, &r.src_b))
        return NULL;
    PyObject *result = NULL;
    if (dst.len != src.len || dst.len % sizeof(uint64_t) || r.rows_a < 0 || r.rows_b < 0 || r.chunk < 0) {
        PyErr_SetString(PyExc_ValueError, "copy_blocks: two uint64 arrays of one length, counts >= 0");
    } else {
        Py_BEGIN_ALLOW_THREADS
        copy_blocks(dst.buf, src.buf, (size_t)dst.len / sizeof(uint64_t), &r);
        Py_END_ALLOW_THREADS
        result = Py_None;
        Py_INCREF(result);
    }
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return result;
}

static PyObject *py_copy_ranges(PyObject *self, PyObject *args) {
    Py_buffer dst, src, len;
    if (!PyArg_ParseTuple(args, "y*y*y*", &dst, &src, &len)) return NULL;
    PyObject *result = NULL;
    size_t n = (size_t)len.len / sizeof(uint64_t);
    if (dst.len != len.len || src.len != len.len || len.len % sizeof(uint64_t)) {
        PyErr_SetString(PyExc_ValueError, "copy_ranges: three uint64 arrays of one length");
    } else {
        Py_BEGIN_ALLOW_THREADS
        copy_ranges(dst.buf, src.buf, len.buf, n);
        Py_END_ALLOW_THREADS
        result = Py_None;
        Py_INCREF(result);
    }
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    PyBuffer_Release(&len);
    return result;
}

static PyMethodDef methods[] = {
    {"copy_ranges", py_copy_ranges, METH_VARARGS,
     "copy_ranges(dst, src, lengths): three uint64 buffers of addresses and byte counts; "
     "copies each range with non-temporal stores, the GIL released."},
    {"copy_blocks", py_copy_blocks, METH_VARARGS,
     "copy_blocks(dst, src, rows_a, rows_b, chunk, dst_a, dst_b, src_a, src_b): for each "
     "pair of block addresses (uint64 buffers), copies chunk bytes at a * stride_a + "
     "b * stride_b for every row (a, b), with non-temporal stores, the GIL released."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_stream_copy", NULL, -1, methods};

PyMODINIT_FUNC PyInit__stream_copy(void) { return PyModule_Create(&module); }
