/*
 * cuda-runner's call helper: one model call in one foreign-function call.
 *
 * Without it, each call crosses from Python into C once per input (to wrap
 * it as a tensor handle), once for Run, and five times per output (address,
 * rank, sizes, strides, dtype). This file does all of that in C, driven by a
 * frame the runtime fills in (cuda_runner/runtime/invoke.py mirrors these
 * structures; docs/bundle-format.md, "Call helper", describes the ABI).
 *
 * `cuda-runner compile` builds it with the system C compiler and stores it in
 * the bundle as a digested segment. It names the aoti_torch_* functions it
 * calls without defining them: like the model library, it is bound to the
 * libtorch already loaded into the process when it is loaded.
 */
#include <stddef.h>
#include <stdint.h>

#include "call_frame.h"

#ifndef CALL_HELPER_ABI  /* tests build other versions to check that a reader falls back */
#define CALL_HELPER_ABI 1
#endif

#define EXPORT __attribute__((visibility("default")))

/* libtorch's C shim (torch/csrc/inductor/aoti_torch/c/shim.h): every call returns 0 on success. */
extern int32_t aoti_torch_create_tensor_from_blob_v2(void *data, int64_t ndim, const int64_t *sizes, const int64_t *strides,
                                                     int64_t storage_offset, int32_t dtype, int32_t device_type,
                                                     int32_t device_index, TensorHandle *result, int32_t layout,
                                                     const uint8_t *opaque_metadata, int64_t opaque_metadata_size);
extern int32_t aoti_torch_delete_tensor_object(TensorHandle tensor);
extern int32_t aoti_torch_get_data_ptr(TensorHandle tensor, void **result);
extern int32_t aoti_torch_get_dim(TensorHandle tensor, int64_t *result);
extern int32_t aoti_torch_get_sizes(TensorHandle tensor, int64_t **result);
extern int32_t aoti_torch_get_strides(TensorHandle tensor, int64_t **result);
extern int32_t aoti_torch_get_dtype(TensorHandle tensor, int32_t *result);
extern int32_t aoti_torch_layout_strided(void);

EXPORT int32_t cuda_runner_call_abi(void) { return CALL_HELPER_ABI; }

/* The sizes of the three structures, so that a caller built for another layout can tell. */
EXPORT void cuda_runner_call_layout(int64_t *sizes) {
    sizes[0] = (int64_t)sizeof(call_frame);
    sizes[1] = (int64_t)sizeof(call_input);
    sizes[2] = (int64_t)sizeof(call_output);
}

static int32_t wrap_inputs(call_frame *frame) {
    const int32_t strided = aoti_torch_layout_strided();
    for (int64_t i = 0; i < frame->input_count; ++i) {
        const call_input *input = &frame->inputs[i];
        frame->input_handles[i] = NULL;
        if (aoti_torch_create_tensor_from_blob_v2(input->data, input->ndim, input->sizes, input->strides, 0, input->dtype,
                                                  frame->device_type, frame->device_index, &frame->input_handles[i],
                                                  strided, NULL, 0) != 0) {
            for (int64_t j = 0; j < i; ++j) aoti_torch_delete_tensor_object(frame->input_handles[j]);
            frame->failed_index = (int32_t)i;
            return CALL_WRAP_FAILED;
        }
    }
    return CALL_OK;
}

static int32_t describe_output(call_output *output) {
    int64_t *sizes = NULL, *strides = NULL;
    if (aoti_torch_get_data_ptr(output->handle, &output->data) != 0) return -1;
    if (aoti_torch_get_dim(output->handle, &output->ndim) != 0) return -1;
    if (aoti_torch_get_sizes(output->handle, &sizes) != 0) return -1;
    if (aoti_torch_get_strides(output->handle, &strides) != 0) return -1;
    if (aoti_torch_get_dtype(output->handle, &output->dtype) != 0) return -1;
    output->sizes = sizes;
    output->strides = strides;
    /* What the caller needs of every output, worked out here rather than in Python. */
    int64_t numel = 1, span = 1, expected = 1;
    int32_t contiguous = 1;
    for (int64_t d = output->ndim - 1; d >= 0; --d) {
        numel *= sizes[d];
        span += (sizes[d] - 1) * strides[d];
        if (sizes[d] != 1 && strides[d] != expected) contiguous = 0;
        expected *= sizes[d];
    }
    output->numel = numel;
    output->span = numel == 0 ? 0 : span;
    output->contiguous = contiguous;
    return 0;
}

/* Wrap the inputs, Run, and describe every output. Input handles are stolen
 * by Run; output handles become the caller's (two outputs may share one). */
EXPORT int32_t cuda_runner_call(call_frame *frame) {
    frame->run_status = 0;
    frame->failed_index = -1;
    int32_t status = wrap_inputs(frame);
    if (status != CALL_OK) return status;
    for (int64_t i = 0; i < frame->output_count; ++i) frame->output_handles[i] = NULL;
    frame->run_status = frame->run(frame->container, frame->input_handles, (size_t)frame->input_count,
                                   frame->output_handles, (size_t)frame->output_count, frame->stream, NULL);
    if (frame->run_status != 0) return CALL_RUN_FAILED;
    for (int64_t i = 0; i < frame->output_count; ++i) frame->outputs[i].handle = frame->output_handles[i];
    for (int64_t i = 0; i < frame->output_count; ++i) {
        if (frame->outputs[i].handle == NULL || describe_output(&frame->outputs[i]) != 0) {
            frame->failed_index = (int32_t)i;
            return CALL_DESCRIBE_FAILED;
        }
    }
    return CALL_OK;
}
