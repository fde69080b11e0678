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
 * The frame it fills is its own (not the Python invoker's): the call helper's
 * ABI 1, from call_frame.h (cuda_runner/runtime/invoke.py checks the sizes). The
 * array types are parameters, so tests can drive it without CuPy.
 *
 * Ownership: a Run's output handles are owned by `Keeper` objects from the
 * moment the helper returns, with no Python code in between; a keeper deletes
 * its handle when the last array over it goes. An output whose bytes meet an
 * input's also keeps the run's inputs alive. Keepers keep their DeviceCall
 * (so the shim's delete function) alive, and count themselves on it, so that
 * the lane's stream outlives every output allocated on it (`close`).
 *
 * One call at a time: a lane serves one call, and the frame is this object's;
 * a second call meanwhile (from a getter it runs, or another thread while the
 * helper runs without the GIL) is refused.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "call_frame.h"

typedef int32_t (*helper_function)(call_frame *);
typedef int32_t (*delete_function)(TensorHandle);

enum { kDtypeCodes = 64 };  /* ScalarType codes the shim can report are far below this */

typedef struct {
    PyObject_HEAD
    helper_function call;
    delete_function delete_handle;
    call_frame frame;
    int64_t **input_dims;   /* per input: sizes then strides, owned here */
    int64_t *input_bytes;   /* per input: its length in bytes, or -1 when not known */
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
    int busy;  /* in run(): a getter it calls, or another thread while the helper runs, may come back */
} DeviceCall;

typedef struct {
    PyObject_HEAD
    TensorHandle handle;
    DeviceCall *owner;
    PyObject *inputs;  /* the run's inputs, where this output views one of them; else NULL */
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

/* Once closed, the last keeper gone and no call in progress: the callback runs. */
static void maybe_last(DeviceCall *owner) {
    if (owner->closed && owner->live_keepers == 0 && !owner->busy) call_on_last(owner);
}

/* A keeper can sit in a cycle (an input's owner that also holds the outputs): it takes part in garbage collection. */
static int keeper_traverse(Keeper *keeper, visitproc visit, void *arg) {
    Py_VISIT(keeper->inputs);
    return 0;
}

static int keeper_clear(Keeper *keeper) {
    Py_CLEAR(keeper->inputs);  /* the handle and the owner go in dealloc */
    return 0;
}

static void keeper_dealloc(Keeper *keeper) {
    PyObject_GC_UnTrack(keeper);
    DeviceCall *owner = keeper->owner;
    if (keeper->handle != NULL) owner->delete_handle(keeper->handle);  /* never fails (the shim's contract) */
    Py_XDECREF(keeper->inputs);
    owner->live_keepers -= 1;
    maybe_last(owner);
    Py_DECREF(owner);
    PyObject_GC_Del(keeper);
}

static PyTypeObject KeeperType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cuda_runner._device_call.Keeper",
    .tp_doc = PyDoc_STR("Owns one output handle; deletes it when collected."),
    .tp_basicsize = sizeof(Keeper),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_dealloc = (destructor)keeper_dealloc,
    .tp_traverse = (traverseproc)keeper_traverse,
    .tp_clear = (inquiry)keeper_clear,
};

static Keeper *new_keeper(DeviceCall *owner, TensorHandle handle, PyObject *inputs) {
    Keeper *keeper = PyObject_GC_New(Keeper, &KeeperType);
    if (keeper == NULL) return NULL;
    Py_INCREF(owner);
    Py_XINCREF(inputs);
    keeper->owner = owner;
    keeper->inputs = inputs;
    keeper->handle = handle;
    owner->live_keepers += 1;
    PyObject_GC_Track(keeper);
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
    free(self->input_bytes);
    self->input_dims = NULL;
    self->input_shapes = NULL;
    self->input_bytes = NULL;
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

/* One entry of the dtypes table: code -> (dtype, itemsize). */
static int read_dtype(DeviceCall *self, PyObject *key, PyObject *value) {
    long code = PyLong_AsLong(key);
    PyObject *dtype;
    Py_ssize_t itemsize;
    if (code == -1 && PyErr_Occurred()) return -1;
    if (code < 0 || code >= kDtypeCodes) {
        PyErr_Format(PyExc_ValueError, "dtype code %ld is out of range", code);
        return -1;
    }
    if (!PyTuple_Check(value) || !PyArg_ParseTuple(value, "On", &dtype, &itemsize)) {
        if (!PyErr_Occurred() || PyErr_ExceptionMatches(PyExc_SystemError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "dtype code %ld: not a (dtype, itemsize) pair", code);
        }
        return -1;
    }
    if (itemsize <= 0 || itemsize > 64) {  /* the widest dtype is 16 bytes: a bound keeps every byte count in range */
        PyErr_Format(PyExc_ValueError, "dtype code %ld has item size %zd", code, itemsize);
        return -1;
    }
    Py_INCREF(dtype);
    Py_XSETREF(self->dtypes[code], dtype);
    self->itemsizes[code] = itemsize;
    return 0;
}

static int read_dtypes(DeviceCall *self, PyObject *dtypes) {
    if (!PyDict_Check(dtypes)) {
        PyErr_SetString(PyExc_TypeError, "dtypes must be a dict of code: (dtype, itemsize)");
        return -1;
    }
    PyObject *items = PyDict_Items(dtypes);  /* a snapshot: reading a code can run Python code, which could change the dict */
    if (items == NULL) return -1;
    int status = 0;
    for (Py_ssize_t i = 0; status == 0 && i < PyList_GET_SIZE(items); ++i) {
        PyObject *pair = PyList_GET_ITEM(items, i);
        status = read_dtype(self, PyTuple_GET_ITEM(pair, 0), PyTuple_GET_ITEM(pair, 1));
    }
    Py_DECREF(items);
    return status;
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
    PyObject *dtype_codes = PySequence_Tuple(input_dtypes);  /* a copy: reading a code can run Python code */
    if (dtype_codes == NULL) return NULL;
    Py_ssize_t input_count = PyTuple_GET_SIZE(dtype_codes);
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
    self->input_bytes = calloc((size_t)input_count + 1, sizeof(int64_t));
    if (!frame->inputs || !frame->outputs || !frame->input_handles || !frame->output_handles || !self->input_dims || !self->input_shapes ||
        !self->input_bytes) {
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
        long code = PyLong_AsLong(PyTuple_GET_ITEM(dtype_codes, i));
        if (code == -1 && PyErr_Occurred()) goto failed;
        if (code < INT32_MIN || code > INT32_MAX) {
            PyErr_Format(PyExc_ValueError, "dtype code %ld is out of range", code);
            goto failed;
        }
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
        if (__builtin_mul_overflow(running, size > 1 ? (int64_t)size : 1, &running)) {
            PyErr_SetString(PyExc_OverflowError, "an array's shape overflows 64-bit strides");
            free(dims);
            return -1;
        }
    }
    free(self->input_dims[index]);
    self->input_dims[index] = dims;
    call_input *input = &self->frame.inputs[index];
    int32_t code = input->dtype;
    Py_ssize_t itemsize = code >= 0 && code < kDtypeCodes ? self->itemsizes[code] : 0;
    int64_t numel = 1, bytes = -1;
    int overflowed = 0;
    for (Py_ssize_t d = 0; d < rank; ++d) overflowed |= __builtin_mul_overflow(numel, dims[d], &numel);
    if (itemsize > 0 && !overflowed && !__builtin_mul_overflow(numel, (int64_t)itemsize, &bytes)) self->input_bytes[index] = bytes;
    else self->input_bytes[index] = -1;
    input->sizes = dims;
    input->strides = dims + rank;
    input->ndim = rank;
    Py_INCREF(shape);
    Py_XSETREF(self->input_shapes[index], shape);
    return 0;
}

/* Whether `shape` is exactly the sizes input `index` has now: a plain tuple of
 * plain ints, read as numbers (an element's own __eq__ is not asked). */
static int same_layout(DeviceCall *self, Py_ssize_t index, PyObject *shape) {
    const call_input *input = &self->frame.inputs[index];
    if (self->input_shapes[index] == NULL || !PyTuple_CheckExact(shape) || PyTuple_GET_SIZE(shape) != input->ndim) return 0;
    for (Py_ssize_t d = 0; d < input->ndim; ++d) {
        PyObject *item = PyTuple_GET_ITEM(shape, d);
        int overflow = 0;
        if (!PyLong_CheckExact(item) || PyLong_AsLongLongAndOverflow(item, &overflow) != input->sizes[d] || overflow) return 0;
    }
    return 1;
}

/* 1 when every input is in the frame, 0 when the Python path must take the call, -1 on error. */
static int fill_inputs(DeviceCall *self, PyObject *arrays) {
    for (Py_ssize_t i = 0; i < self->frame.input_count; ++i) {
        PyObject *array = PyTuple_GET_ITEM(arrays, i);
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
        int same = same_layout(self, i, shape);
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
        long long value;
        PyObject *item = __builtin_mul_overflow(values[d], scale, &value) ? NULL : PyLong_FromLongLong(value);
        if (item == NULL) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_OverflowError, "an output's strides overflow 64 bits");
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
    long long length;
    if (__builtin_mul_overflow(output->span, (long long)itemsize, &length)) {
        PyErr_SetString(PyExc_OverflowError, "an output's length overflows 64 bits");
        return NULL;
    }
    PyObject *address = PyLong_FromVoidPtr(output->data);
    PyObject *nbytes = PyLong_FromLongLong(length);
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

/* Whether output `index` may view memory of an input: its byte range meets one
 * of theirs (or a length is not known). Only such outputs keep the inputs alive:
 * an output fed back in as the next call's input must not keep every earlier one. */
static int views_an_input(const DeviceCall *self, Py_ssize_t index) {
    const call_output *output = &self->frame.outputs[index];
    int32_t code = output->dtype;
    Py_ssize_t itemsize = code >= 0 && code < kDtypeCodes ? self->itemsizes[code] : 0;
    long long length;
    if (itemsize == 0 || __builtin_mul_overflow(output->span, (long long)itemsize, &length)) return 1;
    if (length == 0) return 0;
    uintptr_t start = (uintptr_t)output->data, end = start + (uintptr_t)length;
    for (int64_t i = 0; i < self->frame.input_count; ++i) {
        int64_t bytes = self->input_bytes[i];
        if (bytes < 0) return 1;
        uintptr_t input_start = (uintptr_t)self->frame.inputs[i].data;
        if (bytes > 0 && start < input_start + (uintptr_t)bytes && input_start < end) return 1;
    }
    return 0;
}

/* Whether any output with the same handle as output `index` (aliases share a keeper) views an input. */
static int handle_views_an_input(const DeviceCall *self, Py_ssize_t index) {
    for (Py_ssize_t j = index; j < (Py_ssize_t)self->frame.output_count; ++j)
        if (self->frame.output_handles[j] == self->frame.output_handles[index] && views_an_input(self, j)) return 1;
    return 0;
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
            keepers[kept] = new_keeper(self, handles[kept], handle_views_an_input(self, kept) ? inputs : NULL);
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

static PyObject *run_once(DeviceCall *self, PyObject *given);

static PyObject *device_call_run(DeviceCall *self, PyObject *given) {
    if (self->closed) {
        PyErr_SetString(PyExc_RuntimeError, "the device call is closed");
        return NULL;
    }
    /* One call at a time: the frame is this object's. A getter that calls back,
     * or a second thread while the GIL is released, is refused. */
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "the device call is already running a call");
        return NULL;
    }
    self->busy = 1;
    PyObject *result = run_once(self, given);
    self->busy = 0;
    maybe_last(self);  /* closed during the call: the callback waited for it */
    return result;
}

static PyObject *run_once(DeviceCall *self, PyObject *given) {
    /* A tuple of its own: the attributes read below run Python code, which could change a list given. */
    PyObject *arrays = PySequence_Tuple(given);
    if (arrays == NULL) return NULL;
    PyObject *result = NULL;
    if (PyTuple_GET_SIZE(arrays) != (Py_ssize_t)self->frame.input_count) {
        PyErr_Format(PyExc_ValueError, "%zd inputs for %lld", PyTuple_GET_SIZE(arrays), (long long)self->frame.input_count);
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
    if (status != CALL_OK) {
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
    maybe_last(self);  /* else when the last output goes, or the call in progress ends */
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
