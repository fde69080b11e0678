/*
 * The floor for per-call overhead: a C program that calls the container's Run
 * directly on a model library, with no Python in the loop. Used by
 * scripts/bench_compare.py (libtorch) and scripts/bench_standalone.py (both),
 * which build it with `cc -O2 bench_floor.c -ldl`.
 *
 *   bench_floor LIBTORCH_DIR MODEL.so WEIGHTS.blob cpu|cuda ITERATIONS DTYPE:D0xD1x... [...]
 *   bench_floor --shim=_aoti_shim.so [--cudart=libcudart.so.13] RENAMED.so WEIGHTS.blob cpu|cuda ITERATIONS DTYPE:...
 *
 * Options (--sync-each-call, --median) go before LIBTORCH_DIR or --shim.
 *
 * With LIBTORCH_DIR the tensor handles are libtorch's (aoti_torch_*). With
 * --shim they are cuda-runner's own shim's (cudarunner_*), and MODEL.so must be
 * a copy of the library whose imports cuda_runner.format.elf.rename_imports
 * renamed to the shim's names, as cuda-runner loads it. Before the shim, as
 * cuda_runner/runtime/providers.py does, the program makes global the CUDA
 * runtime (for CUDA; --cudart, else libcudart.so.13 or .12 from the loader's
 * path), which such libraries call without naming it, and libstdc++.so.6, so
 * that a library that links libstdc++ statically binds all of its C++ runtime
 * to one copy.
 *
 * Each iteration wraps the (already resident) inputs as tensor handles, runs,
 * and deletes the output handles, which is the least any caller must do.
 * It prints the mean microseconds per call over ITERATIONS calls, synchronized
 * once at the end (and after warm-up); --sync-each-call synchronizes the
 * stream after every Run instead (as a caller that waits for each result does),
 * and --median prints the median call's microseconds after the mean. With
 * --shim it checks that the calls left no tensor handle behind.
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

static void *open_or_die(const char *path, int mode) {
    void *library = dlopen(path, mode);
    if (!library) {
        fprintf(stderr, "%s\n", dlerror());
        exit(2);
    }
    return library;
}

static int compare_doubles(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* A tensor function of the provider: aoti_torch_NAME, or cudarunner_NAME. */
static void *tensor_function(void *provider, const char *prefix, const char *name) {
    char full[256];
    snprintf(full, sizeof full, "%s%s", prefix, name);
    return need(provider, full);
}

int main(int argc, char **argv) {
    const char *shim_path = NULL, *cudart_path = NULL, *lib_dir = NULL;
    int sync_each = 0, with_median = 0;
    int first = 1;  /* the first positional argument after the options */
    for (; first < argc && strncmp(argv[first], "--", 2) == 0; first++) {
        if (strncmp(argv[first], "--shim=", 7) == 0) shim_path = argv[first] + 7;
        else if (strncmp(argv[first], "--cudart=", 9) == 0) cudart_path = argv[first] + 9;
        else if (strcmp(argv[first], "--sync-each-call") == 0) sync_each = 1;
        else if (strcmp(argv[first], "--median") == 0) with_median = 1;
        else break;
    }
    if (!shim_path && first < argc) lib_dir = argv[first++];
    if (argc < first + 5) {
        fprintf(stderr, "usage: %s [--sync-each-call] [--median] LIBTORCH_DIR|--shim=SHIM.so [--cudart=LIBCUDART] "
                        "MODEL.so WEIGHTS.blob cpu|cuda ITERATIONS DTYPE:SHAPE...\n", argv[0]);
        return 2;
    }
    const char *model_path = argv[first], *weights_path = argv[first + 1], *device = argv[first + 2];
    int cuda = strcmp(device, "cuda") == 0;
    long iterations = atol(argv[first + 3]);
    void *provider;
    const char *prefix;
    if (shim_path) {
        prefix = "cudarunner_";
        if (cuda) {
            void *cudart = cudart_path ? dlopen(cudart_path, RTLD_NOW | RTLD_GLOBAL) : NULL;
            if (!cudart) cudart = dlopen("libcudart.so.13", RTLD_NOW | RTLD_GLOBAL);
            if (!cudart) cudart = dlopen("libcudart.so.12", RTLD_NOW | RTLD_GLOBAL);
            if (!cudart) {
                fprintf(stderr, "cannot load the CUDA runtime (pass --cudart=PATH): %s\n", dlerror());
                return 2;
            }
        }
        dlopen("libstdc++.so.6", RTLD_NOW | RTLD_GLOBAL);  /* none on this machine: the libraries bring their own */
        provider = open_or_die(shim_path, RTLD_NOW | RTLD_GLOBAL);
    } else {
        prefix = "aoti_torch_";
        open_global(lib_dir, "libc10.so");
        provider = open_global(lib_dir, "libtorch_cpu.so");
        if (cuda) {
            open_global(lib_dir, "libc10_cuda.so");
            open_global(lib_dir, "libtorch_cuda.so");
        }
    }
    void *stream = NULL;
    stream_sync_fn stream_sync = NULL;
    if (cuda) {
        void *driver = open_or_die("libcuda.so.1", RTLD_NOW);
        ((cu_init_fn)need(driver, "cuInit"))(0);
        stream_sync = (stream_sync_fn)need(driver, "cuStreamSynchronize");
    }
    void *model = open_or_die(model_path, RTLD_NOW | RTLD_LOCAL);
    create_fn create = need(model, "AOTInductorModelContainerCreateWithDevice");
    run_fn run = need(model, "AOTInductorModelContainerRun");
    count_fn num_outputs = need(model, "AOTInductorModelContainerGetNumOutputs");
    count_fn num_constants = need(model, "AOTInductorModelContainerGetNumConstants");
    blob_fn load_blob = need(model, "AOTInductorModelUpdateConstantsFromBlob");
    from_blob_fn from_blob = tensor_function(provider, prefix, "create_tensor_from_blob_v2");
    empty_fn empty = tensor_function(provider, prefix, "empty_strided");
    data_ptr_fn data_ptr = tensor_function(provider, prefix, "get_data_ptr");
    delete_fn delete_tensor = tensor_function(provider, prefix, "delete_tensor_object");
    int64_t (*live_tensors)(void) = shim_path ? need(provider, "cudarunner_shim_live_tensors") : NULL;

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
        uint8_t *blob = read_file(weights_path);
        if (!blob || load_blob(container, blob)) return fail("load the weights");
        free(blob);
    }
    int inputs = argc - (first + 4);
    if (inputs > MAX_INPUTS) return fail("take more than 16 inputs");
    int32_t dtypes[MAX_INPUTS];
    int64_t ranks[MAX_INPUTS], sizes[MAX_INPUTS][MAX_DIMS], strides[MAX_INPUTS][MAX_DIMS];
    void *data[MAX_INPUTS];
    for (int i = 0; i < inputs; i++) {
        char *spec = argv[first + 4 + i];
        dtypes[i] = (int32_t)strtol(spec, &spec, 10);
        ranks[i] = 0;
        while ((*spec == ':' || *spec == 'x') && ranks[i] < MAX_DIMS) {
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
    if (outputs > 64) return fail("take more than 64 outputs");
    Handle in[MAX_INPUTS], out[64];
    int64_t live_before = 0;
    double started = 0, call_started = 0;
    double *times = with_median ? calloc(iterations > 0 ? iterations : 1, sizeof(double)) : NULL;
    for (long n = -10; n < iterations; n++) {
        if (n == 0) {
            if (cuda) stream_sync(stream);
            if (live_tensors) live_before = live_tensors();
            started = now();
        }
        if (times) call_started = now();
        for (int i = 0; i < inputs; i++) {
            from_blob(data[i], ranks[i], sizes[i], strides[i], 0, dtypes[i], cuda ? 1 : 0, 0, &in[i], 0, NULL, 0);
        }
        if (run(container, in, inputs, out, outputs, stream, NULL)) return fail("run");
        if (cuda && sync_each) stream_sync(stream);
        for (size_t o = 0; o < outputs; o++) {
            int seen = 0;  /* aliased outputs share a handle: delete it once */
            for (size_t p = 0; p < o; p++) seen |= out[p] == out[o];
            if (!seen && out[o]) delete_tensor(out[o]);
        }
        if (times && n >= 0) times[n] = now() - call_started;
    }
    if (cuda) stream_sync(stream);
    double per_call = (now() - started) / iterations * 1e6;
    if (live_tensors && live_tensors() != live_before) {
        fprintf(stderr, "the calls left %lld tensor handles behind\n", (long long)(live_tensors() - live_before));
        return 3;
    }
    if (times) {
        qsort(times, iterations, sizeof(double), compare_doubles);
        printf("%.3f %.3f\n", per_call, times[iterations / 2] * 1e6);
    } else {
        printf("%.3f\n", per_call);
    }
    return 0;
}
