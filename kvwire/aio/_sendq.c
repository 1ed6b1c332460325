/* kvwire.aio._sendq: a stream's send queue, written to a non-blocking TCP socket with
 * scatter-gather sendmsg() and the GIL released.
 *
 * The queue holds frame parts in order: plain buffers (headers, params, small payloads,
 * control frames) and checked payloads (a CHUNK's payload followed by its CRC32C trailer;
 * kvwire.wire.frames.CheckedPayload).  flush() writes until the queue is empty or the
 * kernel takes no more (EAGAIN); the event loop calls it again when the socket is
 * writable.  A checked payload is handed to the kernel a piece (`piece` bytes) per write.
 * Right after a write the next piece is checksummed, so the kernel's copy of it then reads
 * it from the cache (a piece and its copy fit a core's L2 cache); bytes the kernel takes
 * before they were checksummed (a payload's first piece) are checksummed right after the
 * write, while still in the cache from its copy.  The trailer goes out once the whole
 * payload has been taken.  A payload in several buffers (a
 * KV chunk's K and V, the rows of a paged cache's blocks) is a chain of checked parts: each
 * but the last has no trailer and hands its CRC on to the next, and one write takes up to
 * a piece's worth of them.  So no checksum stands between
 * the socket becoming writable and its refill, and each byte is read from memory once (as
 * it is not when a whole frame waits in a transport's buffer, checksummed long before the
 * kernel reads it again).
 *
 * The CRC is the kvwire.wire._crc32c module's (its dispatched loop, taken through a
 * capsule), so both compute the same function by construction.  This is I/O, so it lives
 * in kvwire.aio; the sans-IO core only hands it frame parts.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>

#ifndef MSG_NOSIGNAL
#define MSG_NOSIGNAL 0
#endif

#define IOV_PARTS 64 /* iovec entries per sendmsg() (IOV_MAX is at least 1024 on Linux) */

typedef uint32_t (*crc_update_fn)(uint32_t crc, const uint8_t* p, size_t n);
static crc_update_fn crc_update; /* standard CRC32C value in, value out (like crc32c()) */

typedef struct {
    Py_buffer view;     /* a range part's buf/len are its range of the buffer */
    int borrowed;       /* a range of a buffer another part (the item's last range) holds */
    void* held_buf;     /* the last range of a ranges item: the buffer as acquired, */
    Py_ssize_t held_len; /* restored before it is released (held_buf != NULL) */
    Py_ssize_t off;     /* bytes of view written */
    int checked;        /* a payload followed by its 4-byte big-endian CRC32C trailer */
    int more;           /* checked, no trailer: the next part continues the payload and its CRC */
    uint32_t crc;       /* checked: CRC of the frame through the first `ck` payload bytes */
    Py_ssize_t ck;      /* checked: payload bytes checksummed (at least `off` once written) */
    uint8_t trailer[4];
    int trailer_off;    /* checked: trailer bytes written */
} Part;

typedef struct {
    PyObject_HEAD
    int fd;
    Py_ssize_t piece; /* most bytes of a checked payload handed to the kernel per write */
    Part* parts;
    Py_ssize_t head, count, cap; /* parts[head .. count) are queued */
    Py_ssize_t pending;          /* bytes queued, trailers included */
    int busy;                    /* flush() is writing without the GIL */
} SendQueue;

static int check_free(SendQueue* q) {
    if (q->busy) {
        /* a flush on another thread, or a call from code a push or a release ran (an
         * __index__, a finalizer): either would move the parts under the running call */
        PyErr_SetString(PyExc_RuntimeError, "SendQueue is in use (by another thread, or re-entered)");
        return -1;
    }
    return 0;
}

static int check_idle(SendQueue* q) {
    if (check_free(q) < 0) return -1;
    if (q->piece <= 0) {
        PyErr_SetString(PyExc_ValueError, "SendQueue was not initialised");
        return -1;
    }
    return 0;
}

static void release_range(SendQueue* q, Py_ssize_t from, Py_ssize_t to) {
    for (Py_ssize_t i = from; i < to; i++) {
        Part* p = &q->parts[i];
        if (p->borrowed) continue;
        if (p->held_buf != NULL) {
            p->view.buf = p->held_buf;
            p->view.len = p->held_len;
        }
        PyBuffer_Release(&p->view);
    }
}

static void compact(SendQueue* q) {
    if (q->head == 0) return;
    memmove(q->parts, q->parts + q->head, (size_t)(q->count - q->head) * sizeof(Part));
    q->count -= q->head;
    q->head = 0;
}

static int grow(SendQueue* q, Py_ssize_t extra) {
    if (q->count + extra <= q->cap) return 0;
    compact(q);
    if (q->count + extra <= q->cap) return 0;
    Py_ssize_t cap = q->cap ? q->cap : 16;
    while (cap < q->count + extra) cap *= 2;
    Part* p = PyMem_Realloc(q->parts, (size_t)cap * sizeof(Part));
    if (p == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    q->parts = p;
    q->cap = cap;
    return 0;
}

static int sq_init(SendQueue* q, PyObject* args, PyObject* kwds) {
    static char* kwlist[] = {"fd", "piece", NULL};
    int fd;
    Py_ssize_t piece = 512 * 1024;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "i|n", kwlist, &fd, &piece)) return -1;
    if (fd < 0 || piece <= 0) {
        PyErr_SetString(PyExc_ValueError, "SendQueue needs a descriptor >= 0 and piece > 0");
        return -1;
    }
    /* checked after the arguments' conversions (an __index__ may push or start a flush):
     * a running call's fd and piece, and queued parts' socket, stay as they are */
    if (check_free(q) < 0) return -1;
    if (q->head < q->count) {
        PyErr_SetString(PyExc_RuntimeError, "SendQueue has parts queued: clear() it before re-initialising");
        return -1;
    }
    q->fd = fd;
    q->piece = piece;
    return 0;
}

static void sq_dealloc(SendQueue* q) {
    release_range(q, q->head, q->count);
    PyMem_Free(q->parts);
    Py_TYPE(q)->tp_free((PyObject*)q);
}

PyDoc_STRVAR(push_doc,
             "push(parts, /)\n--\n\n"
             "Queue frame parts in order: each a C-contiguous buffer, or a (payload, crc)\n"
             "tuple: a payload followed by the big-endian CRC32C trailer of the frame, whose\n"
             "CRC up to the payload is crc.  A (payload, crc, True) tuple has no trailer: the\n"
             "payload goes on in the next part, a checked tuple of the same call whose crc is\n"
             "ignored (it continues this one's); parts of such a chain must not be empty.\n"
             "A (buffer, crc, more, spans) tuple is a checked payload made of ranges of one\n"
             "buffer, in order: spans is a C-contiguous buffer of int64 (start, size) pairs,\n"
             "each range non-empty and inside buffer (a chain of parts, no Python object per\n"
             "range).  Nothing is written: see flush().  The buffers are held (and must not\n"
             "change) until they are written or clear() drops them.");

/* Value `i` of an int64 array that may not be aligned. */
static int64_t int64_at(const void* buf, Py_ssize_t i) {
    int64_t v;
    memcpy(&v, (const char*)buf + i * (Py_ssize_t)sizeof(int64_t), sizeof(v));
    return v;
}

/* The (start, size) int64 pairs of a ranges part, checked against the buffer's length:
 * their count, or -1 with an exception set. */
static Py_ssize_t read_spans(PyObject* spans, Py_ssize_t buflen, Py_buffer* out) {
    if (PyObject_GetBuffer(spans, out, PyBUF_SIMPLE) < 0) return -1;
    if (!PyBuffer_IsContiguous(out, 'C') || out->len % (Py_ssize_t)(2 * sizeof(int64_t)) || out->len == 0) {
        PyBuffer_Release(out);
        PyErr_SetString(PyExc_ValueError, "spans must be a non-empty C-contiguous buffer of int64 (start, size) pairs");
        return -1;
    }
    Py_ssize_t n = out->len / (Py_ssize_t)(2 * sizeof(int64_t));
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t start = int64_at(out->buf, 2 * i), size = int64_at(out->buf, 2 * i + 1);
        if (start < 0 || size <= 0 || start > (int64_t)buflen - size) {
            PyBuffer_Release(out);
            PyErr_Format(PyExc_ValueError, "range %zd (start %lld, size %lld) is empty or outside a buffer of %zd bytes",
                         i, (long long)start, (long long)size, buflen);
            return -1;
        }
    }
    return n;
}

static void set_trailer(Part* p) {
    uint32_t c = p->crc;
    p->trailer[0] = (uint8_t)(c >> 24);
    p->trailer[1] = (uint8_t)(c >> 16);
    p->trailer[2] = (uint8_t)(c >> 8);
    p->trailer[3] = (uint8_t)c;
}

/* Parts a push item becomes: a ranges item one per range (its spans' pairs), else one;
 * -1 with an exception set. */
static Py_ssize_t item_parts(PyObject* item) {
    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 4) return 1;
    Py_buffer spans;
    if (PyObject_GetBuffer(PyTuple_GET_ITEM(item, 3), &spans, PyBUF_SIMPLE) < 0) return -1;
    Py_ssize_t n = spans.len / (Py_ssize_t)(2 * sizeof(int64_t));
    PyBuffer_Release(&spans);
    return n > 0 ? n : 1; /* an empty one is refused below */
}

/* The error of a push whose ranges items' spans took more parts than item_parts()
 * counted and push() reserved: code a conversion ran (a crc's __index__, a more flag's
 * __bool__, a __buffer__) made them longer in between. */
static void spans_changed(void) {
    PyErr_SetString(PyExc_ValueError, "a ranges item's spans changed while it was pushed");
}

/* A ranges item (buffer, crc, more, spans) as parts from `at`, below `end` (the slots
 * push() reserved): a chain of checked parts, one per range, the buffer held by the last.
 * The parts added, or -1 with an exception set (nothing held). */
static Py_ssize_t push_ranges(SendQueue* q, Py_ssize_t at, Py_ssize_t end, PyObject* item, Py_ssize_t* bytes) {
    unsigned long long v = PyLong_AsUnsignedLongLongMask(PyTuple_GET_ITEM(item, 1));
    if (v == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    int more = PyObject_IsTrue(PyTuple_GET_ITEM(item, 2));
    if (more < 0) return -1;
    Py_buffer base, spans;
    if (PyObject_GetBuffer(PyTuple_GET_ITEM(item, 0), &base, PyBUF_SIMPLE) < 0) return -1;
    if (!PyBuffer_IsContiguous(&base, 'C')) {
        PyBuffer_Release(&base);
        PyErr_SetString(PyExc_BufferError, "push() needs C-contiguous buffers");
        return -1;
    }
    Py_ssize_t count = read_spans(PyTuple_GET_ITEM(item, 3), base.len, &spans);
    if (count < 0) {
        PyBuffer_Release(&base);
        return -1;
    }
    if (count > end - at) { /* the spans grew since they were counted (by code a conversion ran) */
        PyBuffer_Release(&spans);
        PyBuffer_Release(&base);
        spans_changed();
        return -1;
    }
    for (Py_ssize_t r = 0; r < count; r++) {
        Part* p = &q->parts[at + r];
        memset(p, 0, sizeof(*p));
        p->view = base; /* shallow copies: the last one holds the buffer */
        p->view.buf = (char*)base.buf + int64_at(spans.buf, 2 * r);
        p->view.len = (Py_ssize_t)int64_at(spans.buf, 2 * r + 1);
        p->borrowed = r + 1 < count;
        p->checked = 1;
        p->more = r + 1 < count ? 1 : more;
        p->crc = (uint32_t)v;
        *bytes += p->view.len;
    }
    Part* last = &q->parts[at + count - 1];
    last->held_buf = base.buf;
    last->held_len = base.len;
    if (!last->more) *bytes += 4;
    PyBuffer_Release(&spans);
    return count;
}

static PyObject* sq_push(SendQueue* q, PyObject* arg) {
    if (check_idle(q) < 0) return NULL;
    if (!PySequence_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "push() needs a sequence of parts");
        return NULL;
    }
    PyObject* seq = PySequence_Tuple(arg); /* a copy: the caller's list may change meanwhile */
    if (seq == NULL) return NULL;
    q->busy = 1; /* what a part's conversion runs (an __index__) cannot move the parts */
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t k = item_parts(PySequence_Fast_GET_ITEM(seq, i));
        if (k < 0) {
            q->busy = 0;
            Py_DECREF(seq);
            return NULL;
        }
        total += k;
    }
    if (grow(q, total) < 0) {
        q->busy = 0;
        Py_DECREF(seq);
        return NULL;
    }
    /* parts[start .. end) are reserved: every part is written there, even where an
     * earlier ranges item's spans grew after they were counted (then this refuses) */
    Py_ssize_t start = q->count, end = q->count + total, added = 0, bytes = 0;
    int chained = 0; /* the part before has `more`: this one continues its payload */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject* item = PySequence_Fast_GET_ITEM(seq, i);
        if (PyTuple_Check(item) && PyTuple_GET_SIZE(item) == 4) {
            Py_ssize_t k = push_ranges(q, start + added, end, item, &bytes);
            if (k < 0) goto fail;
            added += k;
            chained = q->parts[start + added - 1].more;
            continue;
        }
        if (start + added >= end) {
            spans_changed();
            goto fail;
        }
        Part* p = &q->parts[start + added];
        memset(p, 0, sizeof(*p));
        PyObject* obj = item;
        if (PyTuple_Check(item)) {
            Py_ssize_t size = PyTuple_GET_SIZE(item);
            if (size != 2 && size != 3) {
                PyErr_SetString(PyExc_TypeError,
                                "a checked part is a (payload, crc), (payload, crc, more) or (buffer, crc, more, spans) tuple");
                goto fail;
            }
            unsigned long long v = PyLong_AsUnsignedLongLongMask(PyTuple_GET_ITEM(item, 1));
            if (v == (unsigned long long)-1 && PyErr_Occurred()) goto fail;
            if (size == 3) {
                int more = PyObject_IsTrue(PyTuple_GET_ITEM(item, 2));
                if (more < 0) goto fail;
                p->more = more;
            }
            p->checked = 1;
            p->crc = (uint32_t)v;
            obj = PyTuple_GET_ITEM(item, 0);
        } else if (chained) {
            PyErr_SetString(PyExc_ValueError, "a (payload, crc, True) part must be followed by a checked part");
            goto fail;
        }
        if (PyObject_GetBuffer(obj, &p->view, PyBUF_SIMPLE) < 0) goto fail;
        if (!PyBuffer_IsContiguous(&p->view, 'C')) {
            PyBuffer_Release(&p->view);
            PyErr_SetString(PyExc_BufferError, "push() needs C-contiguous buffers");
            goto fail;
        }
        if ((p->more || chained) && p->view.len == 0) {
            PyBuffer_Release(&p->view);
            PyErr_SetString(PyExc_ValueError, "the parts of a chained payload must not be empty");
            goto fail;
        }
        if (p->checked && p->view.len == 0) set_trailer(p); /* the trailer alone */
        bytes += p->view.len + (p->checked && !p->more ? 4 : 0);
        chained = p->more;
        added++;
    }
    if (chained) {
        PyErr_SetString(PyExc_ValueError, "a (payload, crc, True) part must be followed by a checked part");
        goto fail;
    }
    q->pending += bytes;
    q->count += added;
    q->busy = 0;
    Py_DECREF(seq);
    Py_RETURN_NONE;
fail:
    release_range(q, start, start + added);
    q->busy = 0;
    Py_DECREF(seq);
    return NULL;
}

/* Checksum part `i`'s payload through byte `upto` (> its ck); once the whole payload is,
 * hand its CRC on to the next part of the chain, or set its trailer. */
static void check_to(SendQueue* q, Py_ssize_t i, Py_ssize_t upto) {
    Part* p = &q->parts[i];
    p->crc = crc_update(p->crc, (const uint8_t*)p->view.buf + p->ck, (size_t)(upto - p->ck));
    p->ck = upto;
    if (upto < p->view.len) return;
    if (p->more)
        q->parts[i + 1].crc = p->crc; /* the payload goes on there */
    else
        set_trailer(p);
}

/* Checksum the checked payload bytes the next write will take (up to a piece of them), so
 * that the kernel then copies them from the cache.  Done right after a write: where the
 * kernel took all, the next write follows at once; where it was full, this runs while it
 * drains, not between the socket becoming writable and its refill. */
static void check_ahead(SendQueue* q) {
    Py_ssize_t budget = q->piece;
    for (Py_ssize_t i = q->head, n = 0; i < q->count && n < IOV_PARTS && budget > 0; i++, n++) {
        Part* p = &q->parts[i];
        if (!p->checked) continue;
        Py_ssize_t span = p->view.len - p->off;
        if (span > budget) span = budget;
        if (p->ck < p->off + span) check_to(q, i, p->off + span);
        budget -= span;
    }
}

/* Write until done, EAGAIN or a short write.  Runs without the GIL (`busy` turns away
 * other threads' calls on this queue meanwhile). */
static int write_out(SendQueue* q, int* err) {
    struct iovec iov[IOV_PARTS];
    for (;;) {
        int n_iov = 0;
        size_t want = 0;
        size_t budget = (size_t)q->piece; /* checked payload bytes left for this write */
        for (Py_ssize_t i = q->head; i < q->count && n_iov < IOV_PARTS; i++) {
            Part* p = &q->parts[i];
            Py_ssize_t body = p->view.len - p->off;
            if (body > 0 || !p->checked) {
                size_t len = (size_t)body;
                if (p->checked && len > budget) len = budget;
                iov[n_iov].iov_base = (char*)p->view.buf + p->off;
                iov[n_iov].iov_len = len;
                want += iov[n_iov++].iov_len;
                if (p->checked) {
                    /* A piece at a time (a chained payload's small parts gathered into one,
                     * up to `piece` bytes); the trailer once all is taken. */
                    budget -= len;
                    if (!p->more || len < (size_t)body || budget == 0) break;
                }
                continue;
            }
            iov[n_iov].iov_base = p->trailer + p->trailer_off;
            iov[n_iov].iov_len = (size_t)(4 - p->trailer_off);
            want += iov[n_iov++].iov_len;
        }
        if (n_iov == 0) return 0;
        struct msghdr msg;
        memset(&msg, 0, sizeof(msg));
        msg.msg_iov = iov;
        msg.msg_iovlen = (size_t)n_iov;
        ssize_t sent = sendmsg(q->fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (sent < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
            *err = errno;
            return -1;
        }
        q->pending -= sent;
        size_t left = (size_t)sent;
        while (q->head < q->count) {
            Part* p = &q->parts[q->head];
            size_t body = (size_t)(p->view.len - p->off);
            size_t take = left < body ? left : body;
            if (p->checked && p->ck < p->off + (Py_ssize_t)take) /* what the kernel just copied */
                check_to(q, q->head, p->off + (Py_ssize_t)take);
            p->off += (Py_ssize_t)take;
            left -= take;
            if (take < body) break;
            if (p->checked && !p->more) {
                size_t t = (size_t)(4 - p->trailer_off);
                if (left < t) {
                    p->trailer_off += (int)left;
                    left = 0;
                    break;
                }
                left -= t;
                p->trailer_off = 4;
            }
            q->head++; /* written whole; its buffer is released with the GIL held */
        }
        check_ahead(q);
        if ((size_t)sent < want) return 0; /* the kernel is full: wait until it is writable */
    }
}

PyDoc_STRVAR(flush_doc,
             "flush() -> int\n--\n\n"
             "Write queued parts until none is left or the socket takes no more; the bytes\n"
             "still queued.  Raises OSError for a socket error (the queue is kept; clear()\n"
             "drops it).");

static PyObject* sq_flush(SendQueue* q, PyObject* Py_UNUSED(ignored)) {
    if (check_idle(q) < 0) return NULL;
    Py_ssize_t head = q->head;
    int err = 0, rc;
    q->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    rc = write_out(q, &err);
    Py_END_ALLOW_THREADS
    release_range(q, head, q->head); /* still busy: a finalizer this runs cannot move the parts */
    q->busy = 0;
    if (q->head == q->count) q->head = q->count = 0;
    if (rc < 0) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromSsize_t(q->pending);
}

static PyObject* sq_clear(SendQueue* q, PyObject* Py_UNUSED(ignored)) {
    if (check_idle(q) < 0) return NULL;
    q->busy = 1;
    release_range(q, q->head, q->count);
    q->busy = 0;
    q->head = q->count = 0;
    q->pending = 0;
    Py_RETURN_NONE;
}

static PyObject* sq_get_pending(SendQueue* q, void* Py_UNUSED(closure)) {
    return PyLong_FromSsize_t(q->pending);
}

static PyObject* sq_get_fd(SendQueue* q, void* Py_UNUSED(closure)) { return PyLong_FromLong(q->fd); }

static PyMethodDef sq_methods[] = {
    {"push", (PyCFunction)sq_push, METH_O, push_doc},
    {"flush", (PyCFunction)sq_flush, METH_NOARGS, flush_doc},
    {"clear", (PyCFunction)sq_clear, METH_NOARGS, "clear()\n--\n\nDrop every queued part."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef sq_getset[] = {
    {"pending", (getter)sq_get_pending, NULL, "bytes queued, not yet written", NULL},
    {"fd", (getter)sq_get_fd, NULL, "the socket written to", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject SendQueueType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvwire.aio._sendq.SendQueue",
    .tp_basicsize = sizeof(SendQueue),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = PyDoc_STR("SendQueue(fd, piece=524288)\n--\n\n"
                        "Frame parts queued for a non-blocking socket (it does not own fd):\n"
                        "push(), flush() when writable, pending, clear().  A checked payload\n"
                        "goes out at most `piece` bytes per write, each checksummed as the\n"
                        "kernel takes it; its trailer after the last."),
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)sq_init,
    .tp_dealloc = (destructor)sq_dealloc,
    .tp_methods = sq_methods,
    .tp_getset = sq_getset,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvwire.aio._sendq",
    "A stream's send queue: sendmsg() with the GIL released, payloads checksummed as written.",
    -1, NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__sendq(void) {
    crc_update = (crc_update_fn)PyCapsule_Import("kvwire.wire._crc32c._crc_update", 0);
    if (crc_update == NULL) return NULL;
    if (PyType_Ready(&SendQueueType) < 0) return NULL;
    PyObject* m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&SendQueueType);
    if (PyModule_AddObject(m, "SendQueue", (PyObject*)&SendQueueType) < 0) {
        Py_DECREF(&SendQueueType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
