/*
 * The call helper's ABI 1: the frame a caller fills for one model call, and
 * the statuses of a call. call_helper.c (built into bundles) implements it;
 * device_call.c (the runtime's C glue for run_device) calls it, and
 * cuda_runner/runtime/invoke.py mirrors it with ctypes. docs/bundle-format.md,
 * "Call helper", describes it.
 */
#ifndef CUDA_RUNNER_CALL_FRAME_H
#define CUDA_RUNNER_CALL_FRAME_H

#include <stddef.h>
#include <stdint.h>

typedef void *TensorHandle;
typedef int32_t (*run_function)(void *container, TensorHandle *inputs, size_t input_count, TensorHandle *outputs,
                                size_t output_count, void *stream, void *proxy_executor);

typedef struct {
    void *data;
    const int64_t *sizes;
    const int64_t *strides;
    int64_t ndim;
    int32_t dtype;
    int32_t reserved;
} call_input;

typedef struct {
    TensorHandle handle;   /* owned by the caller after a call that got this far */
    void *data;
    const int64_t *sizes;  /* valid while `handle` lives */
    const int64_t *strides;
    int64_t ndim;
    int64_t numel;
    int64_t span;          /* elements from the first one addressed to one past the last; 0 when empty */
    int32_t dtype;
    int32_t contiguous;    /* row-major, ignoring the strides of size-1 dims */
} call_output;

typedef struct {
    run_function run;
    void *container;
    void *stream;
    call_input *inputs;
    call_output *outputs;
    TensorHandle *input_handles;   /* scratch: input_count entries */
    TensorHandle *output_handles;  /* scratch: output_count entries */
    int64_t input_count;
    int64_t output_count;
    int32_t device_type;
    int32_t device_index;
    int32_t run_status;            /* out: Run's status when it failed */
    int32_t failed_index;          /* out: the input or output that failed */
} call_frame;

enum {
    CALL_OK = 0,
    CALL_WRAP_FAILED = 1,      /* an input could not be wrapped: nothing ran, nothing is owned */
    CALL_RUN_FAILED = 2,       /* Run failed: it took the input handles; no outputs */
    CALL_DESCRIBE_FAILED = 3,  /* an output could not be read: every output handle is the caller's to free */
};

#endif
