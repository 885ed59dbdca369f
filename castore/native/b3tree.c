/* castore.format._b3tree: a chunk's blake3 digest together with the chaining values of
 * its 64 KiB pieces, so that a read of part of a chunk can verify only the
 * pieces it reads (docs/FORMAT.md, "Chunk pieces").
 *
 * The hashing is the BLAKE3 team's own C implementation (blake3.c and its SIMD
 * kernels), compiled in from Debian's librust-blake3-dev sources at build time
 * (tools/blake3_sources.sh); this file only walks its tree. blake3.c is included
 * whole so that its subtree helpers, which are static there, are reachable.
 *
 * A piece is an aligned run of 64 chunks of blake3's 1 KiB (the last piece of a
 * chunk may be shorter). In any input longer than one piece, every piece is a
 * node of blake3's tree: the tree splits an input at the largest power of two
 * of 1 KiB chunks that leaves at least one byte on the right, and for an input
 * over 64 KiB that split is a multiple of 64 KiB. So the digest is the pieces'
 * chaining values merged as parents in the same shape, the last merge a root.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "blake3.c"

#define PIECE_LEN ((size_t)65536)
#define CHUNKS_PER_PIECE (PIECE_LEN / BLAKE3_CHUNK_LEN)

/* The chaining value of one piece (never the root: the input is longer). */
static void piece_cv(const uint8_t *input, size_t len, uint64_t piece_index, uint8_t cv[32]) {
  uint64_t counter = piece_index * CHUNKS_PER_PIECE;
  output_t output;
  if (len <= BLAKE3_CHUNK_LEN) {
    blake3_chunk_state state;
    chunk_state_init(&state, IV, 0);
    state.chunk_counter = counter;
    chunk_state_update(&state, input, len);
    output = chunk_state_output(&state);
  } else {
    uint8_t block[BLAKE3_BLOCK_LEN];
    compress_subtree_to_parent_node(input, len, IV, counter, 0, block);
    output = parent_output(block, IV, 0);
  }
  output_chaining_value(&output, cv);
}

/* Merge n >= 2 consecutive pieces' chaining values as blake3's tree does. */
static void merge(const uint8_t *cvs, size_t n, int root, uint8_t out[32]) {
  if (n == 1) {
    memcpy(out, cvs, 32);
    return;
  }
  size_t left = (size_t)round_down_to_power_of_2((uint64_t)(n - 1));
  uint8_t block[BLAKE3_BLOCK_LEN];
  merge(cvs, left, 0, block);
  merge(cvs + 32 * left, n - left, 0, block + 32);
  output_t output = parent_output(block, IV, 0);
  if (root) {
    output_root_bytes(&output, 0, out, 32);
  } else {
    output_chaining_value(&output, out);
  }
}

static size_t pieces_of(size_t len) { return (len + PIECE_LEN - 1) / PIECE_LEN; }

static void cvs_of(const uint8_t *data, size_t len, uint64_t first, uint8_t *out) {
  size_t n = pieces_of(len);
  for (size_t i = 0; i < n; i++) {
    size_t at = i * PIECE_LEN;
    size_t piece = len - at < PIECE_LEN ? len - at : PIECE_LEN;
    piece_cv(data + at, piece, first + i, out + 32 * i);
  }
}

/* A new bytes object of the chaining values of the pieces of view, the first being
 * piece first of its chunk (hashed without the GIL); NULL with an exception set. */
static PyObject *cvs_object(const Py_buffer *view, uint64_t first) {
  size_t len = (size_t)view->len;
  size_t n = pieces_of(len);
  PyObject *cvs = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(32 * n));
  if (cvs == NULL) return NULL;
  uint8_t *out = (uint8_t *)PyBytes_AS_STRING(cvs);
  Py_BEGIN_ALLOW_THREADS
  cvs_of((const uint8_t *)view->buf, len, first, out);
  Py_END_ALLOW_THREADS
  return cvs;
}

PyDoc_STRVAR(tree_doc,
             "tree(data) -> (digest, cvs)\n\n"
             "The blake3-256 digest of data (longer than one piece) and the 32-byte\n"
             "chaining values of its pieces, in order.");

static PyObject *b3_tree(PyObject *self, PyObject *args) {
  Py_buffer view;
  if (!PyArg_ParseTuple(args, "y*:tree", &view)) return NULL;
  size_t len = (size_t)view.len;
  if (len <= PIECE_LEN) {
    PyBuffer_Release(&view);
    PyErr_SetString(PyExc_ValueError, "tree: the data must be longer than one piece");
    return NULL;
  }
  PyObject *cvs = cvs_object(&view, 0);
  PyBuffer_Release(&view);
  if (cvs == NULL) return NULL;
  uint8_t digest[32];
  merge((const uint8_t *)PyBytes_AS_STRING(cvs), pieces_of(len), 1, digest);
  return Py_BuildValue("(y#N)", (const char *)digest, (Py_ssize_t)32, cvs);
}

PyDoc_STRVAR(piece_cvs_doc,
             "piece_cvs(data, first) -> cvs\n\n"
             "The chaining values of consecutive pieces first, first + 1, ... of a chunk\n"
             "longer than one piece; data starts where piece first starts, and only its\n"
             "last piece may be short (the chunk's own last piece).");

static PyObject *b3_piece_cvs(PyObject *self, PyObject *args) {
  Py_buffer view;
  unsigned long long first;
  if (!PyArg_ParseTuple(args, "y*K:piece_cvs", &view, &first)) return NULL;
  size_t len = (size_t)view.len;
  if (len == 0) {
    PyBuffer_Release(&view);
    PyErr_SetString(PyExc_ValueError, "piece_cvs: no data");
    return NULL;
  }
  PyObject *cvs = cvs_object(&view, (uint64_t)first);
  PyBuffer_Release(&view);
  return cvs;
}

PyDoc_STRVAR(root_doc,
             "root(cvs) -> digest\n\n"
             "The blake3-256 digest of a chunk from its pieces' chaining values (two or more).");

static PyObject *b3_root(PyObject *self, PyObject *args) {
  Py_buffer view;
  if (!PyArg_ParseTuple(args, "y*:root", &view)) return NULL;
  if (view.len < 64 || view.len % 32 != 0) {
    PyBuffer_Release(&view);
    PyErr_SetString(PyExc_ValueError, "root: two or more 32-byte chaining values are needed");
    return NULL;
  }
  uint8_t digest[32];
  merge((const uint8_t *)view.buf, (size_t)view.len / 32, 1, digest);
  PyBuffer_Release(&view);
  return PyBytes_FromStringAndSize((const char *)digest, 32);
}

static PyMethodDef methods[] = {
    {"tree", b3_tree, METH_VARARGS, tree_doc},
    {"piece_cvs", b3_piece_cvs, METH_VARARGS, piece_cvs_doc},
    {"root", b3_root, METH_VARARGS, root_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "castore.format._b3tree",
    "blake3 digests with their 64 KiB pieces' chaining values (docs/FORMAT.md).", -1, methods,
};

PyMODINIT_FUNC PyInit__b3tree(void) {
  PyObject *m = PyModule_Create(&module);
  if (m == NULL) return NULL;
  if (PyModule_AddIntConstant(m, "PIECE", (long)PIECE_LEN) < 0 ||
      PyModule_AddStringConstant(m, "BLAKE3_C", BLAKE3_VERSION_STRING) < 0) {
    Py_DECREF(m);
    return NULL;
  }
  return m;
}
