/*
 * The floor for per-call overhead: a C program that calls the container's Run
 * directly on a model library, with no Python in the loop. Used by
 * scripts/bench_compare.py, which builds it with `cc -O2 bench_floor.c -ldl`.
 *
 *   bench_floor LIBTORCH_DIR MODEL.so WEIGHTS.blob cpu|cuda ITERATIONS DTYPE:D0xD1x... [...]
 *
 * Each iteration wraps the (already resident) inputs as tensor handles, runs,
 * and deletes the output handles, which is the least any caller must do.
 * It prints the mean microseconds per call over ITERATIONS calls, synchronized
 * once at the end (and after warm-up).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef void *Handle;
typedef int32_t (*create_fn)(Handle *, size_t, const char *, const char *);
typedef int32_t (*run_fn)(Handle, Handle *, size_t, Handle *, size_t, void *, void *);
typedef int32_t (*count_fn)(Handle, size_t *);
typedef int32_t (*blob_fn)(Handle, const uint8_t *);
typedef int32_t (*from_blob_fn)(void *, int64_t, const int64_t *, const int64_t *, int64_t, int32_t, int32_t, int32_t,
                                Handle *, int32_t, const uint8_t *, int64_t);
typedef int32_t (*empty_fn)(int64_t, const int64_t *, const int64_t *, int32_t, int32_t, int32_t, Handle *);
typedef int32_t (*data_ptr_fn)(Handle, void **);
typedef int32_t (*delete_fn)(Handle);
typedef int (*stream_create_fn)(void **, unsigned int);
typedef int (*stream_sync_fn)(void *);
typedef int (*cu_init_fn)(unsigned int);

#define MAX_INPUTS 16
#define MAX_DIMS 8

static void *need(void *library, const char *name) {
    void *symbol = dlsym(library, name);
    if (!symbol) {
        fprintf(stderr, "missing symbol %s\n", name);
        exit(2);
    }
    return symbol;
}

static void *open_global(const char *dir, const char *name) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    void *library = dlopen(path, RTLD_NOW | RTLD_GLOBAL);
    if (!library) {
        fprintf(stderr, "%s\n", dlerror());
        exit(2);
    }
    return library;
}

static uint8_t *read_file(const char *path) {
    FILE *file = fopen(path, "rb");
    if (!file) return NULL;
    fseek(file, 0, SEEK_END);
    long size = ftell(file);
    fseek(file, 0, SEEK_SET);
    uint8_t *data = malloc(size > 0 ? size : 1);
    if (size > 0 && fread(data, 1, size, file) != (size_t)size) exit(2);
    fclose(file);
    return data;
}

static size_t element_size(int32_t dtype) {
    switch (dtype) {
        case 0: case 1: case 11: return 1;   /* uint8, int8, bool */
        case 2: case 5: case 15: return 2;   /* int16, float16, bfloat16 */
        case 3: case 6: return 4;            /* int32, float32 */
        default: return 8;                   /* int64, float64 */
    }
}

static int fail(const char *what) {
    fprintf(stderr, "could not %s\n", what);
    return 3;
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    if (argc < 7) {
        fprintf(stderr, "usage: %s LIBTORCH_DIR MODEL.so WEIGHTS.blob cpu|cuda ITERATIONS DTYPE:SHAPE...\n", argv[0]);
        return 2;
    }
    const char *lib_dir = argv[1], *device = argv[4];
    int cuda = strcmp(device, "cuda") == 0;
    long iterations = atol(argv[5]);
    open_global(lib_dir, "libc10.so");
    void *torch_cpu = open_global(lib_dir, "libtorch_cpu.so");
    void *stream = NULL;
    stream_sync_fn stream_sync = NULL;
    if (cuda) {
        open_global(lib_dir, "libc10_cuda.so");
        open_global(lib_dir, "libtorch_cuda.so");
        void *driver = dlopen("libcuda.so.1", RTLD_NOW);
        ((cu_init_fn)need(driver, "cuInit"))(0);
        stream_sync = (stream_sync_fn)need(driver, "cuStreamSynchronize");
    }
    void *model = dlopen(argv[2], RTLD_NOW | RTLD_LOCAL);
    if (!model) {
        fprintf(stderr, "%s\n", dlerror());
        return 2;
    }
    create_fn create = need(model, "AOTInductorModelContainerCreateWithDevice");
    run_fn run = need(model, "AOTInductorModelContainerRun");
    count_fn num_outputs = need(model, "AOTInductorModelContainerGetNumOutputs");
    count_fn num_constants = need(model, "AOTInductorModelContainerGetNumConstants");
    blob_fn load_blob = need(model, "AOTInductorModelUpdateConstantsFromBlob");
    from_blob_fn from_blob = need(torch_cpu, "aoti_torch_create_tensor_from_blob_v2");
    empty_fn empty = need(torch_cpu, "aoti_torch_empty_strided");
    data_ptr_fn data_ptr = need(torch_cpu, "aoti_torch_get_data_ptr");
    delete_fn delete_tensor = need(torch_cpu, "aoti_torch_delete_tensor_object");

    Handle container = NULL;
    if (create(&container, 1, cuda ? "cuda" : "cpu", NULL)) return fail("create the container");
    if (cuda) {
        /* The container initialised the runtime; make its primary context
           current on this thread for the driver API calls below. */
        void *driver = dlopen("libcuda.so.1", RTLD_NOW);
        void *context = NULL;
        ((int (*)(void **, int))need(driver, "cuDevicePrimaryCtxRetain"))(&context, 0);
        ((int (*)(void *))need(driver, "cuCtxSetCurrent"))(context);
        stream_create_fn stream_create = need(driver, "cuStreamCreate");
        int status = stream_create(&stream, 1 /* CU_STREAM_NON_BLOCKING */);
        if (status) {
            fprintf(stderr, "cuStreamCreate: %d\n", status);
            return 3;
        }
    }
    size_t constants = 0, outputs = 0;
    num_constants(container, &constants);
    num_outputs(container, &outputs);
    if (constants) {
        uint8_t *blob = read_file(argv[3]);
        if (!blob || load_blob(container, blob)) return fail("load the weights");
        free(blob);
    }
    int inputs = argc - 6;
    int32_t dtypes[MAX_INPUTS];
    int64_t ranks[MAX_INPUTS], sizes[MAX_INPUTS][MAX_DIMS], strides[MAX_INPUTS][MAX_DIMS];
    void *data[MAX_INPUTS];
    for (int i = 0; i < inputs && i < MAX_INPUTS; i++) {
        char *spec = argv[6 + i];
        dtypes[i] = (int32_t)strtol(spec, &spec, 10);
        ranks[i] = 0;
        while (*spec == ':' || *spec == 'x') {
            sizes[i][ranks[i]++] = strtoll(spec + 1, &spec, 10);
        }
        int64_t stride = 1;
        for (int64_t d = ranks[i] - 1; d >= 0; d--) {
            strides[i][d] = stride;
            stride *= sizes[i][d] > 0 ? sizes[i][d] : 1;
        }
        Handle owner;  /* owns the memory for the whole run; each Run gets a fresh view */
        if (empty(ranks[i], sizes[i], strides[i], dtypes[i], cuda ? 1 : 0, 0, &owner)) return fail("allocate an input");
        data_ptr(owner, &data[i]);
        /* Zero the inputs: uninitialised memory can hold denormals, which
           slow CPU arithmetic by orders of magnitude. */
        size_t bytes = (size_t)stride * element_size(dtypes[i]);
        if (cuda) {
            void *driver = dlopen("libcuda.so.1", RTLD_NOW);
            if (((int (*)(uintptr_t, unsigned char, size_t))need(driver, "cuMemsetD8_v2"))((uintptr_t)data[i], 0, bytes)) return fail("zero an input");
        } else {
            memset(data[i], 0, bytes);
        }
    }
    Handle in[MAX_INPUTS], out[64];
    double started = 0;
    for (long n = -10; n < iterations; n++) {
        if (n == 0) {
            if (cuda) stream_sync(stream);
            started = now();
        }
        for (int i = 0; i < inputs; i++) {
            from_blob(data[i], ranks[i], sizes[i], strides[i], 0, dtypes[i], cuda ? 1 : 0, 0, &in[i], 0, NULL, 0);
        }
        if (run(container, in, inputs, out, outputs, stream, NULL)) return fail("run");
        for (size_t o = 0; o < outputs; o++) {
            int seen = 0;  /* aliased outputs share a handle: delete it once */
            for (size_t p = 0; p < o; p++) seen |= out[p] == out[o];
            if (!seen && out[o]) delete_tensor(out[o]);
        }
    }
    if (cuda) stream_sync(stream);
    printf("%.3f\n", (now() - started) / iterations * 1e6);
    return 0;
}
