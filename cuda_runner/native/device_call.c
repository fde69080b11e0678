/*
 * cuda-runner's device call: one run_device call on CuPy arrays, in C.
 *
 * The call helper (call_helper.c) already wraps the inputs, runs the model and
 * describes its outputs in one foreign call. What was left in Python on every
 * call was glue: reading each input's address and shape, writing the helper's
 * frame through ctypes, reading the outputs back through ctypes, and making
 * the objects a CuPy array needs (an owner for the output handle, CuPy's
 * UnownedMemory, MemoryPointer and ndarray). That glue took several times the
 * helper's own time, so this module does it with the C API instead.
 *
 * It is an optional accelerator: the runtime uses it where it is built and
 * falls back to the same work in Python otherwise, and for any input it does
 * not take (not exactly the array type it was given, or not row-major).
 *
 * The frame it fills is its own (not the Python invoker's), laid out as the
 * call helper's ABI 1 (cuda_runner/runtime/invoke.py checks the sizes). The
 * array types are parameters, so tests can drive it without CuPy.
 *
 * Ownership: a Run's output handles are owned by `Keeper` objects from the
 * moment the helper returns, with no Python code in between; a keeper deletes
 * its handle when the last array over it goes. Keepers keep their DeviceCall
 * (so the shim's delete function) alive, and count themselves on it, so that
 * the lane's stream outlives every output allocated on it (`close`).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef void *TensorHandle;
typedef int32_t (*run_function)(void *, TensorHandle *, size_t, TensorHandle *, size_t, void *, void *);

/* The call helper's ABI 1 structures (call_helper.c). */
typedef struct {
    void *data;
    const int64_t *sizes;
    const int64_t *strides;
    int64_t ndim;
    int32_t dtype;
    int32_t reserved;
} call_input;

typedef struct {
    TensorHandle handle;
    void *data;
    const int64_t *sizes;
    const int64_t *strides;
    int64_t ndim;
    int64_t numel;
    int64_t span;
    int32_t dtype;
    int32_t contiguous;
} call_output;

typedef struct {
    run_function run;
    void *container;
    void *stream;
    call_input *inputs;
    call_output *outputs;
    TensorHandle *input_handles;
    TensorHandle *output_handles;
    int64_t input_count;
    int64_t output_count;
    int32_t device_type;
    int32_t device_index;
    int32_t run_status;
    int32_t failed_index;
} call_frame;

typedef int32_t (*helper_function)(call_frame *);
typedef int32_t (*delete_function)(TensorHandle);

enum { kDtypeCodes = 64 };  /* ScalarType codes the shim can report are far below this */

typedef struct {
    PyObject_HEAD
    helper_function call;
    delete_function delete_handle;
    call_frame frame;
    int64_t **input_dims;   /* per input: sizes then strides, owned here */
    PyObject **input_shapes; /* per input: the shape those dims were made from, or NULL */
    PyTypeObject *array_type;
    PyObject *memory_type;
    PyObject *pointer_type;
    PyObject *dtypes[kDtypeCodes]; /* code -> the dtype object given for it, or NULL */
    Py_ssize_t itemsizes[kDtypeCodes];
    PyObject *device_index;
    PyObject *keep;          /* whatever keeps the shim's delete function loaded */
    PyObject *error;         /* the exception type for an output this cannot make an array of */
    PyObject *on_last;       /* called once closed and no keeper is left */
    Py_ssize_t live_keepers;
    int closed;
} DeviceCall;

typedef struct {
    PyObject_HEAD
    TensorHandle handle;
    DeviceCall *owner;
    PyObject *inputs;  /* an output can view an input: they live as long as it */
} Keeper;

static PyObject *interned_flags, *interned_c_contiguous, *interned_data, *interned_ptr, *interned_shape;

/* -------------------------------------------------------------- keepers */

static void call_on_last(DeviceCall *owner) {
    PyObject *callback = owner->on_last;
    owner->on_last = NULL;
    if (callback == NULL) return;
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);  /* this may run inside a dealloc */
    PyObject *result = PyObject_CallNoArgs(callback);
    if (result == NULL)
        PyErr_WriteUnraisable(callback);
    else
        Py_DECREF(result);
    Py_DECREF(callback);
    PyErr_Restore(type, value, traceback);
}

static void keeper_dealloc(Keeper *keeper) {
    DeviceCall *owner = keeper->owner;
    if (keeper->handle != NULL) owner->delete_handle(keeper->handle);  /* never fails (the shim's contract) */
    Py_XDECREF(keeper->inputs);
    owner->live_keepers -= 1;
    if (owner->closed && owner->live_keepers == 0) call_on_last(owner);
    Py_DECREF(owner);
    Py_TYPE(keeper)->tp_free((PyObject *)keeper);
}

static PyTypeObject KeeperType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cuda_runner._device_call.Keeper",
    .tp_doc = PyDoc_STR("Owns one output handle; deletes it when collected."),
    .tp_basicsize = sizeof(Keeper),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = (destructor)keeper_dealloc,
};

static Keeper *new_keeper(DeviceCall *owner, TensorHandle handle, PyObject *inputs) {
    Keeper *keeper = PyObject_New(Keeper, &KeeperType);
    if (keeper == NULL) return NULL;
    Py_INCREF(owner);
    Py_INCREF(inputs);
    keeper->owner = owner;
    keeper->inputs = inputs;
    keeper->handle = handle;
    owner->live_keepers += 1;
    return keeper;
}

/* -------------------------------------------------------------- construction */

static void free_dims(DeviceCall *self) {
    for (int64_t i = 0; i < self->frame.input_count; ++i) {
        if (self->input_dims != NULL) free(self->input_dims[i]);
        if (self->input_shapes != NULL) Py_CLEAR(self->input_shapes[i]);
    }
    free(self->input_dims);
    free(self->input_shapes);
    self->input_dims = NULL;
    self->input_shapes = NULL;
}

static void device_call_dealloc(DeviceCall *self) {
    free_dims(self);
    free(self->frame.inputs);
    free(self->frame.outputs);
    free(self->frame.input_handles);
    free(self->frame.output_handles);
    Py_XDECREF(self->array_type);
    Py_XDECREF(self->memory_type);
    Py_XDECREF(self->pointer_type);
    for (int code = 0; code < kDtypeCodes; ++code) Py_XDECREF(self->dtypes[code]);
    Py_XDECREF(self->device_index);
    Py_XDECREF(self->keep);
    Py_XDECREF(self->error);
    Py_XDECREF(self->on_last);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static void *address_of(PyObject *value, const char *what) {
    void *address = PyLong_AsVoidPtr(value);
    if (address == NULL && !PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "%s is a null address", what);
    return address;
}

static int read_dtypes(DeviceCall *self, PyObject *dtypes) {
    PyObject *key, *value;
    Py_ssize_t position = 0;
    if (!PyDict_Check(dtypes)) {
        PyErr_SetString(PyExc_TypeError, "dtypes must be a dict of code: (dtype, itemsize)");
        return -1;
    }
    while (PyDict_Next(dtypes, &position, &key, &value)) {
        long code = PyLong_AsLong(key);
        PyObject *dtype;
        Py_ssize_t itemsize;
        if (code == -1 && PyErr_Occurred()) return -1;
        if (code < 0 || code >= kDtypeCodes) {
            PyErr_Format(PyExc_ValueError, "dtype code %ld is out of range", code);
            return -1;
        }
        if (!PyArg_ParseTuple(value, "On", &dtype, &itemsize)) return -1;
        if (itemsize <= 0) {
            PyErr_Format(PyExc_ValueError, "dtype code %ld has item size %zd", code, itemsize);
            return -1;
        }
        Py_INCREF(dtype);
        Py_XSETREF(self->dtypes[code], dtype);
        self->itemsizes[code] = itemsize;
    }
    return 0;
}

static PyObject *device_call_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"helper", "run", "container", "stream", "device_type", "device_index", "input_dtypes", "output_count",
                               "delete", "array_type", "memory_type", "pointer_type", "dtypes", "keep", "error", NULL};
    PyObject *helper, *run, *container, *stream, *input_dtypes, *delete, *array_type, *memory_type, *pointer_type, *dtypes, *keep, *error;
    int device_type, device_index;
    Py_ssize_t output_count;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOiiOnOOOOOOO", keywords, &helper, &run, &container, &stream, &device_type,
                                     &device_index, &input_dtypes, &output_count, &delete, &array_type, &memory_type, &pointer_type,
                                     &dtypes, &keep, &error))
        return NULL;
    if (!PyType_Check(array_type) || !PyExceptionClass_Check(error)) {
        PyErr_SetString(PyExc_TypeError, "array_type must be a type and error an exception type");
        return NULL;
    }
    PyObject *dtype_codes = PySequence_Fast(input_dtypes, "input_dtypes must be a sequence of dtype codes");
    if (dtype_codes == NULL) return NULL;
    Py_ssize_t input_count = PySequence_Fast_GET_SIZE(dtype_codes);
    if (output_count < 0) {
        Py_DECREF(dtype_codes);
        PyErr_SetString(PyExc_ValueError, "a negative output count");
        return NULL;
    }
    DeviceCall *self = (DeviceCall *)type->tp_alloc(type, 0);
    if (self == NULL) {
        Py_DECREF(dtype_codes);
        return NULL;
    }
    call_frame *frame = &self->frame;
    frame->input_count = input_count;
    frame->output_count = output_count;
    frame->device_type = device_type;
    frame->device_index = device_index;
    /* calloc(0) may return NULL: keep one entry. */
    frame->inputs = calloc((size_t)input_count + 1, sizeof(call_input));
    frame->outputs = calloc((size_t)output_count + 1, sizeof(call_output));
    frame->input_handles = calloc((size_t)input_count + 1, sizeof(TensorHandle));
    frame->output_handles = calloc((size_t)output_count + 1, sizeof(TensorHandle));
    self->input_dims = calloc((size_t)input_count + 1, sizeof(int64_t *));
    self->input_shapes = calloc((size_t)input_count + 1, sizeof(PyObject *));
    if (!frame->inputs || !frame->outputs || !frame->input_handles || !frame->output_handles || !self->input_dims || !self->input_shapes) {
        PyErr_NoMemory();
        goto failed;
    }
    self->call = (helper_function)address_of(helper, "the call helper");
    if (self->call == NULL) goto failed;
    frame->run = (run_function)address_of(run, "Run");
    if (frame->run == NULL) goto failed;
    frame->container = address_of(container, "the container");
    if (frame->container == NULL) goto failed;
    frame->stream = stream == Py_None ? NULL : PyLong_AsVoidPtr(stream);
    if (PyErr_Occurred()) goto failed;
    self->delete_handle = (delete_function)address_of(delete, "the shim's delete function");
    if (self->delete_handle == NULL) goto failed;
    for (Py_ssize_t i = 0; i < input_count; ++i) {
        long code = PyLong_AsLong(PySequence_Fast_GET_ITEM(dtype_codes, i));
        if (code == -1 && PyErr_Occurred()) goto failed;
        frame->inputs[i].dtype = (int32_t)code;
    }
    Py_INCREF(array_type);
    self->array_type = (PyTypeObject *)array_type;
    Py_INCREF(memory_type);
    self->memory_type = memory_type;
    Py_INCREF(pointer_type);
    self->pointer_type = pointer_type;
    Py_INCREF(keep);
    self->keep = keep;
    Py_INCREF(error);
    self->error = error;
    self->device_index = PyLong_FromLong(device_index);
    if (self->device_index == NULL || read_dtypes(self, dtypes) != 0) goto failed;
    Py_DECREF(dtype_codes);
    return (PyObject *)self;
failed:
    Py_DECREF(dtype_codes);
    Py_DECREF(self);
    return NULL;
}

/* -------------------------------------------------------------- one call */

/* 1 if `array` can be passed as it is, 0 if the Python path must take the call, -1 on error. */
static int accepts(DeviceCall *self, PyObject *array) {
    if (Py_TYPE(array) != self->array_type) return 0;
    PyObject *flags = PyObject_GetAttr(array, interned_flags);
    if (flags == NULL) return -1;
    PyObject *row_major = PyObject_GetAttr(flags, interned_c_contiguous);
    Py_DECREF(flags);
    if (row_major == NULL) return -1;
    int truth = PyObject_IsTrue(row_major);
    Py_DECREF(row_major);
    return truth;
}

/* Point input `index` at the sizes of `shape`, with row-major strides; kept until the shape changes. */
static int set_layout(DeviceCall *self, Py_ssize_t index, PyObject *shape) {
    if (!PyTuple_Check(shape)) {
        PyErr_SetString(PyExc_TypeError, "an array's shape is not a tuple");
        return -1;
    }
    Py_ssize_t rank = PyTuple_GET_SIZE(shape);
    int64_t *dims = malloc(sizeof(int64_t) * 2 * (size_t)(rank > 0 ? rank : 1));
    if (dims == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    int64_t running = 1;
    for (Py_ssize_t d = rank - 1; d >= 0; --d) {
        long long size = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, d));
        if (size < 0) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "a negative size");
            free(dims);
            return -1;
        }
        dims[d] = size;
        dims[rank + d] = running;
        running *= size > 1 ? size : 1;
    }
    free(self->input_dims[index]);
    self->input_dims[index] = dims;
    call_input *input = &self->frame.inputs[index];
    input->sizes = dims;
    input->strides = dims + rank;
    input->ndim = rank;
    Py_INCREF(shape);
    Py_XSETREF(self->input_shapes[index], shape);
    return 0;
}

/* 1 when every input is in the frame, 0 when the Python path must take the call, -1 on error. */
static int fill_inputs(DeviceCall *self, PyObject *arrays) {
    for (Py_ssize_t i = 0; i < self->frame.input_count; ++i) {
        PyObject *array = PySequence_Fast_GET_ITEM(arrays, i);
        int accepted = accepts(self, array);
        if (accepted != 1) return accepted;
        PyObject *memory = PyObject_GetAttr(array, interned_data);
        if (memory == NULL) return -1;
        PyObject *pointer = PyObject_GetAttr(memory, interned_ptr);
        Py_DECREF(memory);
        if (pointer == NULL) return -1;
        void *address = PyLong_AsVoidPtr(pointer);
        Py_DECREF(pointer);
        if (address == NULL && PyErr_Occurred()) return -1;
        PyObject *shape = PyObject_GetAttr(array, interned_shape);
        if (shape == NULL) return -1;
        PyObject *known = self->input_shapes[i];
        int same = known == NULL ? 0 : PyObject_RichCompareBool(known, shape, Py_EQ);
        if (same == 0) same = set_layout(self, i, shape) == 0 ? 1 : -1;
        Py_DECREF(shape);
        if (same < 0) return -1;
        self->frame.inputs[i].data = address;
    }
    return 1;
}

/* Delete the distinct non-null handles among the first `count` outputs. */
static void delete_outputs(DeviceCall *self, Py_ssize_t first, Py_ssize_t count) {
    TensorHandle *handles = self->frame.output_handles;
    for (Py_ssize_t i = first; i < count; ++i) {
        TensorHandle handle = handles[i];
        if (handle == NULL) continue;
        for (Py_ssize_t j = i; j < count; ++j)
            if (handles[j] == handle) handles[j] = NULL;
        self->delete_handle(handle);
    }
}

static PyObject *tuple_of(const int64_t *values, int64_t rank, int64_t scale) {
    PyObject *tuple = PyTuple_New((Py_ssize_t)rank);
    if (tuple == NULL) return NULL;
    for (int64_t d = 0; d < rank; ++d) {
        PyObject *item = PyLong_FromLongLong(values[d] * scale);
        if (item == NULL) {
            Py_DECREF(tuple);
            return NULL;
        }
        PyTuple_SET_ITEM(tuple, (Py_ssize_t)d, item);
    }
    return tuple;
}

/* memory_type(address, nbytes, owner, device), pointer_type(memory, 0), array_type(shape, dtype, pointer, strides). */
static PyObject *output_array(DeviceCall *self, const call_output *output, PyObject *keeper) {
    int32_t code = output->dtype;
    if (code < 0 || code >= kDtypeCodes || self->dtypes[code] == NULL) {
        PyErr_Format(self->error, "an output has dtype code %d, which run_device cannot return as a device array", code);
        return NULL;
    }
    Py_ssize_t itemsize = self->itemsizes[code];
    PyObject *address = PyLong_FromVoidPtr(output->data);
    PyObject *nbytes = PyLong_FromLongLong(output->span * (long long)itemsize);
    PyObject *memory = NULL, *pointer = NULL, *shape = NULL, *strides = NULL, *array = NULL;
    if (address == NULL || nbytes == NULL) goto done;
    PyObject *memory_args[] = {address, nbytes, keeper, self->device_index};
    memory = PyObject_Vectorcall(self->memory_type, memory_args, 4, NULL);
    if (memory == NULL) goto done;
    PyObject *zero = PyLong_FromLong(0);
    if (zero == NULL) goto done;
    PyObject *pointer_args[] = {memory, zero};
    pointer = PyObject_Vectorcall(self->pointer_type, pointer_args, 2, NULL);
    Py_DECREF(zero);
    if (pointer == NULL) goto done;
    shape = tuple_of(output->sizes, output->ndim, 1);
    if (shape == NULL) goto done;
    /* Row-major: the array type works the strides out itself, which costs less than passing them. */
    if (output->contiguous) {
        strides = Py_None;
        Py_INCREF(strides);
    } else {
        strides = tuple_of(output->strides, output->ndim, (int64_t)itemsize);
        if (strides == NULL) goto done;
    }
    PyObject *array_args[] = {shape, self->dtypes[code], pointer, strides};
    array = PyObject_Vectorcall((PyObject *)self->array_type, array_args, 4, NULL);
done:
    Py_XDECREF(address);
    Py_XDECREF(nbytes);
    Py_XDECREF(memory);
    Py_XDECREF(pointer);
    Py_XDECREF(shape);
    Py_XDECREF(strides);
    return array;
}

/* The outputs as arrays, each handle owned by a keeper from the start. */
static PyObject *adopt_outputs(DeviceCall *self, PyObject *inputs) {
    Py_ssize_t count = (Py_ssize_t)self->frame.output_count;
    TensorHandle *handles = self->frame.output_handles;
    Keeper *stack_keepers[8];
    Keeper **keepers = count <= 8 ? stack_keepers : calloc((size_t)count, sizeof(Keeper *));
    PyObject *arrays = NULL;
    Py_ssize_t kept = 0;
    if (keepers == NULL) {
        PyErr_NoMemory();
        delete_outputs(self, 0, count);
        return NULL;
    }
    for (; kept < count; ++kept) {
        keepers[kept] = NULL;
        for (Py_ssize_t earlier = 0; earlier < kept; ++earlier) {
            if (handles[earlier] == handles[kept]) {  /* an aliased output shares its keeper */
                keepers[kept] = keepers[earlier];
                Py_INCREF(keepers[kept]);
                break;
            }
        }
        if (keepers[kept] == NULL) {
            keepers[kept] = new_keeper(self, handles[kept], inputs);
            if (keepers[kept] == NULL) break;
        }
    }
    if (kept < count) {  /* out of memory: handles not yet kept are freed here, the others by their keepers */
        for (Py_ssize_t i = 0; i < kept; ++i)
            for (Py_ssize_t j = kept; j < count; ++j)
                if (handles[j] == handles[i]) handles[j] = NULL;
        delete_outputs(self, kept, count);
        goto done;
    }
    arrays = PyList_New(count);
    if (arrays == NULL) goto done;
    for (Py_ssize_t i = 0; i < count; ++i) {
        PyObject *array = output_array(self, &self->frame.outputs[i], (PyObject *)keepers[i]);
        if (array == NULL) {
            Py_CLEAR(arrays);
            goto done;
        }
        PyList_SET_ITEM(arrays, i, array);
    }
done:
    for (Py_ssize_t i = 0; i < kept; ++i) Py_DECREF(keepers[i]);
    if (keepers != stack_keepers) free(keepers);
    return arrays;
}

PyDoc_STRVAR(run_doc,
             "run(arrays) -> list | int | None\n\n"
             "One call: the output arrays; None when an input is not exactly the array type or not row-major\n"
             "(the caller takes the call); otherwise the helper's failure status, with failed_index and\n"
             "run_status set and every output handle already freed.");

static PyObject *device_call_run(DeviceCall *self, PyObject *given) {
    if (self->closed) {
        PyErr_SetString(PyExc_RuntimeError, "the device call is closed");
        return NULL;
    }
    PyObject *arrays = PySequence_Fast(given, "run() takes a sequence of arrays");
    if (arrays == NULL) return NULL;
    PyObject *result = NULL;
    if (PySequence_Fast_GET_SIZE(arrays) != (Py_ssize_t)self->frame.input_count) {
        PyErr_Format(PyExc_ValueError, "%zd inputs for %lld", PySequence_Fast_GET_SIZE(arrays), (long long)self->frame.input_count);
        goto done;
    }
    int filled = fill_inputs(self, arrays);
    if (filled <= 0) {
        if (filled == 0) result = Py_NewRef(Py_None);
        goto done;
    }
    /* The helper leaves the output slots alone when an input cannot be wrapped: clear them, so a failure frees nothing stale. */
    memset(self->frame.output_handles, 0, sizeof(TensorHandle) * (size_t)self->frame.output_count);
    int32_t status;
    Py_BEGIN_ALLOW_THREADS
    status = self->call(&self->frame);
    Py_END_ALLOW_THREADS
    if (status != 0) {
        delete_outputs(self, 0, (Py_ssize_t)self->frame.output_count);
        result = PyLong_FromLong(status);
        goto done;
    }
    result = adopt_outputs(self, arrays);  /* Run wrote the handles into frame.output_handles */
done:
    Py_DECREF(arrays);
    return result;
}

PyDoc_STRVAR(close_doc,
             "close(on_last)\n\n"
             "Take no more calls; call on_last() once no output array made here is left (now, if none is).");

static PyObject *device_call_close(DeviceCall *self, PyObject *on_last) {
    if (self->closed) Py_RETURN_NONE;
    self->closed = 1;
    Py_INCREF(on_last);
    Py_XSETREF(self->on_last, on_last);
    if (self->live_keepers == 0) call_on_last(self);
    Py_RETURN_NONE;
}

static PyObject *device_call_layout(PyObject *module, PyObject *unused) {
    return Py_BuildValue("(nnn)", (Py_ssize_t)sizeof(call_frame), (Py_ssize_t)sizeof(call_input), (Py_ssize_t)sizeof(call_output));
}

static PyObject *get_failed_index(DeviceCall *self, void *unused) { return PyLong_FromLong(self->frame.failed_index); }
static PyObject *get_run_status(DeviceCall *self, void *unused) { return PyLong_FromLong(self->frame.run_status); }
static PyObject *get_live_keepers(DeviceCall *self, void *unused) { return PyLong_FromSsize_t(self->live_keepers); }

static PyMethodDef device_call_methods[] = {
    {"run", (PyCFunction)device_call_run, METH_O, run_doc},
    {"close", (PyCFunction)device_call_close, METH_O, close_doc},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef device_call_getset[] = {
    {"failed_index", (getter)get_failed_index, NULL, "the input or output the last failed call stopped at", NULL},
    {"run_status", (getter)get_run_status, NULL, "Run's status in the last failed call", NULL},
    {"live_keepers", (getter)get_live_keepers, NULL, "output handles still owned by arrays made here", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject DeviceCallType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cuda_runner._device_call.DeviceCall",
    .tp_doc = PyDoc_STR("One lane's run_device calls through the call helper, without Python per call."),
    .tp_basicsize = sizeof(DeviceCall),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = device_call_new,
    .tp_dealloc = (destructor)device_call_dealloc,
    .tp_methods = device_call_methods,
    .tp_getset = device_call_getset,
};

static PyMethodDef module_methods[] = {
    {"layout", device_call_layout, METH_NOARGS, "The sizes of the frame, input and output structures, as the helper's ABI 1 has them."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_definition = {
    PyModuleDef_HEAD_INIT, "_device_call", "run_device's per-call glue in C (cuda_runner/native/device_call.c).", -1, module_methods,
};

PyMODINIT_FUNC PyInit__device_call(void) {
    if (PyType_Ready(&KeeperType) < 0 || PyType_Ready(&DeviceCallType) < 0) return NULL;
    interned_flags = PyUnicode_InternFromString("flags");
    interned_c_contiguous = PyUnicode_InternFromString("c_contiguous");
    interned_data = PyUnicode_InternFromString("data");
    interned_ptr = PyUnicode_InternFromString("ptr");
    interned_shape = PyUnicode_InternFromString("shape");
    if (!interned_flags || !interned_c_contiguous || !interned_data || !interned_ptr || !interned_shape) return NULL;
    PyObject *module = PyModule_Create(&module_definition);
    if (module == NULL) return NULL;
    Py_INCREF(&DeviceCallType);
    if (PyModule_AddObject(module, "DeviceCall", (PyObject *)&DeviceCallType) < 0) {
        Py_DECREF(&DeviceCallType);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
