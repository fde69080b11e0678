/*
 * cuda-runner's graphed host call: one replay of a captured CUDA graph on
 * NumPy arrays, in C.
 *
 * A graph captured for host arrays (cuda_runner/runtime/graphs.py) copies its
 * inputs from pinned buffers of its own and its outputs into more of them, so
 * a replay is: write the inputs' bytes into those buffers, launch the graph,
 * wait for the stream, copy each output into a fresh array. In Python that
 * took about half of a call's host time (lookups, a NumPy copy per input, a
 * view and a copy per output), on top of the method's checks; in a decode
 * loop that waits for every step the host's time adds to the GPU's. This
 * module does the whole call, checks included, in one foreign call.
 *
 * It is an optional accelerator, and it takes only calls it can take whole:
 * a dict holding exactly the graph's inputs, each exactly the array type with
 * the dtype object and shape the graph was captured for, row-major, and every
 * value of a bounded input (a position in a KV cache) inside its bounds, the
 * span of positions a counted input starts (a prompt's) inside its span.
 * Anything else returns None before anything is queued, and the caller makes
 * the call the ordinary way, which refuses bad input with its own message.
 * Bounds are checked on the bytes already copied into the pinned buffers,
 * so what is checked is what the GPU reads.
 *
 * NumPy is reached without its C API (the module builds without NumPy's
 * headers): attributes for the dtype and shape, the buffer protocol for the
 * bytes, and numpy.empty, given as a parameter, for the outputs. The CUDA
 * driver's functions are given as addresses, so tests can drive it without a
 * GPU.
 *
 * The graph and the pinned buffers belong to the caller, who frees them when
 * the method closes: it calls close() first, after which this object forgets
 * them and refuses calls (graphs.py does so). `keep` holds the buffers' arrays
 * for as long as this object lives, but does not keep their memory.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef int (*launch_function)(void *graph, void *stream);    /* cuGraphLaunch */
typedef int (*synchronize_function)(void *stream);            /* cuStreamSynchronize */
typedef int (*current_function)(void **context);              /* cuCtxGetCurrent */
typedef int (*make_current_function)(void *context);          /* cuCtxSetCurrent */

/* An input or output: its name, dtype and shape, and the graph's pinned buffer for its bytes. */
typedef struct {
    PyObject *name;
    PyObject *dtype;   /* the exact dtype object taken, or made */
    PyObject *shape;   /* a tuple of ints */
    char *staging;
    Py_ssize_t nbytes;
} staged_tensor;

typedef struct {
    staged_tensor tensor;
    int bounded;       /* 0, or the element size (4 or 8) of a signed integer input with bounds */
    int64_t low, high;
    int spanned;       /* 0, or the element size of an input with span bounds: first >= span_low, first + count - 1 <= span_high */
    int64_t span_low, span_high;
} graph_input;

typedef staged_tensor graph_output;

typedef struct {
    PyObject_HEAD
    launch_function launch;
    synchronize_function synchronize;
    current_function current;
    make_current_function make_current;
    void *graph;
    void *stream;
    void *context;  /* the context the graph belongs to, made current where another one is (as the caller's path would) */
    Py_ssize_t input_count, output_count;
    graph_input *inputs;
    graph_output *outputs;
    PyTypeObject *array_type;
    PyObject *empty;  /* numpy.empty */
    PyObject *fail;   /* fail(function_name, status) raises for a CUDA error */
    PyObject *keep;
    int busy;
    int closed;
} GraphCall;

static PyObject *interned_dtype, *interned_shape;

static void clear_tensor(staged_tensor *tensor) {
    Py_XDECREF(tensor->name);
    Py_XDECREF(tensor->dtype);
    Py_XDECREF(tensor->shape);
}

static void graph_call_dealloc(GraphCall *self) {
    for (Py_ssize_t index = 0; self->inputs != NULL && index < self->input_count; index++) clear_tensor(&self->inputs[index].tensor);
    for (Py_ssize_t index = 0; self->outputs != NULL && index < self->output_count; index++) clear_tensor(&self->outputs[index]);
    PyMem_Free(self->inputs);
    PyMem_Free(self->outputs);
    Py_XDECREF(self->array_type);
    Py_XDECREF(self->empty);
    Py_XDECREF(self->fail);
    Py_XDECREF(self->keep);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* NULL for None; an error set (check PyErr_Occurred) for anything but an int. */
static void *address_of(PyObject *number) {
    return number == Py_None ? NULL : PyLong_AsVoidPtr(number);
}

/* None, or (low, high, element size) of a signed integer input: the size into *size, the range into *low and *high. */
static int read_range(PyObject *range, Py_ssize_t nbytes, int *size, int64_t *low, int64_t *high) {
    if (range == Py_None) return 0;
    long long given_low, given_high;
    if (!PyArg_ParseTuple(range, "LLi", &given_low, &given_high, size)) return -1;
    if ((*size != 4 && *size != 8) || nbytes % *size != 0) {
        PyErr_SetString(PyExc_ValueError, "bounds are for int32 or int64 inputs");
        return -1;
    }
    *low = given_low;
    *high = given_high;
    return 0;
}

/* A tensor's staging buffer checked, then its references taken (last: nothing after them can fail). */
static int read_tensor(PyObject *name, PyObject *dtype, PyObject *shape, PyObject *staging, Py_ssize_t nbytes, staged_tensor *tensor) {
    tensor->staging = address_of(staging);
    if (PyErr_Occurred()) return -1;
    if (nbytes < 0 || (nbytes > 0 && tensor->staging == NULL)) {
        PyErr_Format(PyExc_ValueError, "%U: its staging buffer is missing", name);
        return -1;
    }
    tensor->nbytes = nbytes;
    tensor->name = Py_NewRef(name);
    tensor->dtype = Py_NewRef(dtype);
    tensor->shape = Py_NewRef(shape);
    return 0;
}

/* (name, dtype, shape, staging address, nbytes, bounds, span bounds), each bounds None or (low, high, element size). */
static int read_input(PyObject *entry, graph_input *input) {
    PyObject *name, *dtype, *shape, *staging, *bounds, *span;
    Py_ssize_t nbytes;
    if (!PyArg_ParseTuple(entry, "UOO!OnOO", &name, &dtype, &PyTuple_Type, &shape, &staging, &nbytes, &bounds, &span)) return -1;
    if (read_range(bounds, nbytes, &input->bounded, &input->low, &input->high) < 0) return -1;
    if (read_range(span, nbytes, &input->spanned, &input->span_low, &input->span_high) < 0) return -1;
    return read_tensor(name, dtype, shape, staging, nbytes, &input->tensor);
}

/* (name, dtype, shape, staging address, nbytes). */
static int read_output(PyObject *entry, graph_output *output) {
    PyObject *name, *dtype, *shape, *staging;
    Py_ssize_t nbytes;
    if (!PyArg_ParseTuple(entry, "UOO!On", &name, &dtype, &PyTuple_Type, &shape, &staging, &nbytes)) return -1;
    return read_tensor(name, dtype, shape, staging, nbytes, output);
}

static PyObject *graph_call_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"launch", "synchronize", "current", "make_current", "graph", "stream", "context", "inputs", "outputs",
                               "array_type", "empty", "fail", "keep", NULL};
    PyObject *launch, *synchronize, *current, *make_current, *graph, *stream, *context, *inputs, *outputs, *array_type, *empty, *fail, *keep;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "$OOOOOOOO!O!O!OOO", keywords, &launch, &synchronize, &current, &make_current, &graph,
                                     &stream, &context, &PyList_Type, &inputs, &PyList_Type, &outputs, &PyType_Type, &array_type, &empty,
                                     &fail, &keep))
        return NULL;
    GraphCall *self = (GraphCall *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    PyObject *addresses[] = {launch, synchronize, current, make_current, graph, stream, context};
    void *values[7];
    for (int index = 0; index < 7; index++) {
        values[index] = address_of(addresses[index]);
        if (PyErr_Occurred()) goto failed;
    }
    self->launch = (launch_function)values[0];
    self->synchronize = (synchronize_function)values[1];
    self->current = (current_function)values[2];
    self->make_current = (make_current_function)values[3];
    self->graph = values[4];
    self->stream = values[5];
    self->context = values[6];
    if (self->launch == NULL || self->synchronize == NULL || self->current == NULL || self->make_current == NULL) {
        PyErr_SetString(PyExc_ValueError, "launch, synchronize, current and make_current must be function addresses");
        goto failed;
    }
    self->array_type = (PyTypeObject *)Py_NewRef(array_type);
    self->empty = Py_NewRef(empty);
    self->fail = Py_NewRef(fail);
    self->keep = Py_NewRef(keep);
    Py_ssize_t input_count = PyList_GET_SIZE(inputs), output_count = PyList_GET_SIZE(outputs);
    self->inputs = PyMem_Calloc((size_t)input_count + 1, sizeof(graph_input));
    self->outputs = PyMem_Calloc((size_t)output_count + 1, sizeof(graph_output));
    if (self->inputs == NULL || self->outputs == NULL) {
        PyErr_NoMemory();
        goto failed;
    }
    for (; self->input_count < input_count; self->input_count++)
        if (read_input(PyList_GET_ITEM(inputs, self->input_count), &self->inputs[self->input_count]) < 0) goto failed;
    for (; self->output_count < output_count; self->output_count++)
        if (read_output(PyList_GET_ITEM(outputs, self->output_count), &self->outputs[self->output_count]) < 0) goto failed;
    return (PyObject *)self;
failed:
    Py_DECREF(self);
    return NULL;
}

/* 1: the attribute `name` of `array` is `expected` (the same object; for a shape, an equal tuple); 0: not; -1: error. */
static int attribute_is(PyObject *array, PyObject *name, PyObject *expected, int equal) {
    PyObject *value = PyObject_GetAttr(array, name);
    if (value == NULL) return -1;
    int same = value == expected ? 1 : equal ? PyObject_RichCompareBool(value, expected, Py_EQ) : 0;
    Py_DECREF(value);
    return same;
}

static int64_t element(const char *data, int size, Py_ssize_t index) {
    if (size == 8) {
        int64_t value;
        memcpy(&value, data + index * 8, 8);
        return value;
    }
    int32_t narrow;
    memcpy(&narrow, data + index * 4, 4);
    return narrow;
}

static int within_bounds(const graph_input *input) {
    if (input->bounded) {
        Py_ssize_t count = input->tensor.nbytes / input->bounded;
        for (Py_ssize_t index = 0; index < count; index++) {
            int64_t value = element(input->tensor.staging, input->bounded, index);
            if (value < input->low || value > input->high) return 0;
        }
    }
    if (input->spanned && input->tensor.nbytes > 0) {
        /* The positions first .. first + count - 1, the last compared as first <= high - (count - 1), where nothing overflows
         * but the subtraction for a high near int64's least, which no first can then meet. */
        int64_t first = element(input->tensor.staging, input->spanned, 0), count = input->tensor.nbytes / input->spanned, latest_first;
        if (__builtin_sub_overflow(input->span_high, count - 1, &latest_first)) return 0;
        if (first < input->span_low || first > latest_first) return 0;
    }
    return 1;
}

/* 1: every input copied into its staging buffer and inside its bounds; 0: not taken; -1: error. */
static int stage_inputs(GraphCall *self, PyObject *given) {
    if (!PyDict_CheckExact(given) || PyDict_GET_SIZE(given) != self->input_count) return 0;
    /* Keys of exactly str: a lookup then compares them in C, never through a subclass's __eq__ (Python code, run while the lane is held). */
    Py_ssize_t position = 0;
    PyObject *key, *value;
    while (PyDict_Next(given, &position, &key, &value))
        if (!PyUnicode_CheckExact(key)) return 0;
    for (Py_ssize_t index = 0; index < self->input_count; index++) {
        staged_tensor *input = &self->inputs[index].tensor;
        PyObject *array = PyDict_GetItemWithError(given, input->name);  /* borrowed: the attributes below run no code of the dict's */
        if (array == NULL) return PyErr_Occurred() ? -1 : 0;
        if (Py_TYPE(array) != self->array_type) return 0;
        Py_INCREF(array);  /* a getter below may run Python code that drops the dict's reference */
        int taken = attribute_is(array, interned_dtype, input->dtype, 0);
        if (taken == 1) taken = attribute_is(array, interned_shape, input->shape, 1);
        if (taken == 1) {
            Py_buffer view;
            if (PyObject_GetBuffer(array, &view, PyBUF_C_CONTIGUOUS) < 0) {
                /* Not row-major (or no buffer): the caller's path makes it so. */
                if (PyErr_ExceptionMatches(PyExc_BufferError) || PyErr_ExceptionMatches(PyExc_ValueError)) {
                    PyErr_Clear();
                    taken = 0;
                } else {
                    taken = -1;
                }
            } else {
                if (view.len != input->nbytes) {
                    taken = 0;
                } else if (input->nbytes > 0) {
                    memcpy(input->staging, view.buf, (size_t)input->nbytes);
                }
                PyBuffer_Release(&view);
            }
        }
        Py_DECREF(array);
        if (taken != 1) return taken;
    }
    for (Py_ssize_t index = 0; index < self->input_count; index++)
        if (!within_bounds(&self->inputs[index])) return 0;
    return 1;
}

static PyObject *failed(GraphCall *self, const char *function, int status) {
    PyObject *raised = PyObject_CallFunction(self->fail, "si", function, status);
    if (raised != NULL) {
        Py_DECREF(raised);
        PyErr_Format(PyExc_RuntimeError, "%s failed: CUDA error %d", function, status);
    }
    return NULL;
}

static PyObject *fresh_output(GraphCall *self, const graph_output *output) {
    PyObject *arguments[2] = {output->shape, output->dtype};
    PyObject *array = PyObject_Vectorcall(self->empty, arguments, 2, NULL);
    if (array == NULL || output->nbytes == 0) return array;
    Py_buffer view;
    if (PyObject_GetBuffer(array, &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        Py_DECREF(array);
        return NULL;
    }
    if (view.len != output->nbytes) {
        PyBuffer_Release(&view);
        Py_DECREF(array);
        PyErr_Format(PyExc_RuntimeError, "output %R: a fresh array holds %zd bytes, the graph's %zd", output->name, view.len, output->nbytes);
        return NULL;
    }
    memcpy(view.buf, output->staging, (size_t)output->nbytes);
    PyBuffer_Release(&view);
    return array;
}

static PyObject *call_once(GraphCall *self, PyObject *given) {
    void *context = NULL;
    if (self->current(&context) != 0) Py_RETURN_NONE;
    if (context != self->context && self->make_current(self->context) != 0) Py_RETURN_NONE;  /* the caller's path sets the device itself */
    int staged = stage_inputs(self, given);
    if (staged <= 0) {
        if (staged < 0) return NULL;
        Py_RETURN_NONE;
    }
    int status = self->launch(self->graph, self->stream);
    if (status != 0) return failed(self, "cuGraphLaunch", status);
    Py_BEGIN_ALLOW_THREADS
    status = self->synchronize(self->stream);
    Py_END_ALLOW_THREADS
    if (status != 0) return failed(self, "cuStreamSynchronize", status);
    PyObject *outputs = PyDict_New();
    if (outputs == NULL) return NULL;
    for (Py_ssize_t index = 0; index < self->output_count; index++) {
        PyObject *array = fresh_output(self, &self->outputs[index]);
        if (array == NULL || PyDict_SetItem(outputs, self->outputs[index].name, array) < 0) {
            Py_XDECREF(array);
            Py_DECREF(outputs);
            return NULL;
        }
        Py_DECREF(array);
    }
    return outputs;
}

PyDoc_STRVAR(run_doc,
             "run(inputs) -> dict | None\n\n"
             "One replay: the outputs by name, as fresh arrays; None, with nothing queued, for a call this does not take\n"
             "(see the module's comment). A CUDA error is raised through fail(function_name, status).");

static PyObject *graph_call_run(GraphCall *self, PyObject *given) {
    if (self->closed) {
        PyErr_SetString(PyExc_RuntimeError, "the graph call is closed");
        return NULL;
    }
    /* One call at a time: the staging buffers are this object's. */
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "the graph call is already running a call");
        return NULL;
    }
    self->busy = 1;
    PyObject *result = call_once(self, given);
    self->busy = 0;
    return result;
}

PyDoc_STRVAR(close_doc,
             "close()\n\n"
             "Forget the graph and the buffers (their owner is about to free them): every later call is refused.");

static PyObject *graph_call_close(GraphCall *self, PyObject *unused) {
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "the graph call is running a call");
        return NULL;
    }
    self->closed = 1;
    self->graph = NULL;
    for (Py_ssize_t index = 0; index < self->input_count; index++) self->inputs[index].tensor.staging = NULL;
    for (Py_ssize_t index = 0; index < self->output_count; index++) self->outputs[index].staging = NULL;
    Py_CLEAR(self->keep);
    Py_RETURN_NONE;
}

static PyMethodDef graph_call_methods[] = {
    {"run", (PyCFunction)graph_call_run, METH_O, run_doc},
    {"close", (PyCFunction)graph_call_close, METH_NOARGS, close_doc},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject GraphCallType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cuda_runner._graph_call.GraphCall",
    .tp_doc = PyDoc_STR("A captured graph's host calls: stage, launch, wait and copy out, without Python per call."),
    .tp_basicsize = sizeof(GraphCall),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = graph_call_new,
    .tp_dealloc = (destructor)graph_call_dealloc,
    .tp_methods = graph_call_methods,
};

static struct PyModuleDef module_definition = {
    PyModuleDef_HEAD_INIT, "_graph_call", "A graphed method's host calls in C (cuda_runner/native/graph_call.c).", -1, NULL,
};

PyMODINIT_FUNC PyInit__graph_call(void) {
    if (PyType_Ready(&GraphCallType) < 0) return NULL;
    interned_dtype = PyUnicode_InternFromString("dtype");
    interned_shape = PyUnicode_InternFromString("shape");
    if (!interned_dtype || !interned_shape) return NULL;
    PyObject *module = PyModule_Create(&module_definition);
    if (module == NULL) return NULL;
    Py_INCREF(&GraphCallType);
    if (PyModule_AddObject(module, "GraphCall", (PyObject *)&GraphCallType) < 0) {
        Py_DECREF(&GraphCallType);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
