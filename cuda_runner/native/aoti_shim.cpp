/*
 * cuda-runner's own AOTInductor shim: the aoti_torch_* functions a model
 * library calls, over a small tensor type of our own, so that libraries run
 * without libtorch (docs/standalone-runtime.md).
 *
 * Every function is exported as cudarunner_<name> instead of aoti_torch_<name>.
 * The two prefixes have the same length, and the runtime renames the
 * library's undefined aoti_torch_ symbols to cudarunner_ in its private copy
 * before loading it (runtime/providers.py). A library bound this way can never
 * resolve a function to libtorch, and libtorch's own libraries never resolve
 * to ours, so both providers can live in one process.
 *
 * CUDA is reached through the driver API (libcuda.so.1, loaded on first use),
 * so building this file needs no CUDA toolkit. Device memory is allocated
 * stream-ordered (cuMemAllocAsync) on the calling thread's current stream, the
 * stream the generated code makes current for the length of a run; memory
 * allocated during a CUDA graph capture therefore becomes part of the graph.
 *
 * Status codes: 0 success, 1 failure; the failure's message is kept per
 * thread (cudarunner_shim_last_error).
 */
#include <dlfcn.h>
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu_kernels.h"

#define EXPORT extern "C" __attribute__((visibility("default")))
#define SHIM_ABI_VERSION 1

namespace {

using Status = int32_t;
constexpr Status kOk = 0;
constexpr Status kFailure = 1;

// c10::ScalarType codes (the values libtorch's shim reports).
enum Dtype : int32_t {
  kUInt8 = 0, kInt8 = 1, kInt16 = 2, kInt32 = 3, kInt64 = 4, kFloat16 = 5, kFloat32 = 6, kFloat64 = 7,
  kComplex32 = 8, kComplex64 = 9, kComplex128 = 10, kBool = 11, kBFloat16 = 15, kFloat8E5M2 = 23,
  kFloat8E4M3FN = 24, kFloat8E5M2FNUZ = 25, kFloat8E4M3FNUZ = 26, kUInt16 = 27, kUInt32 = 28, kUInt64 = 29,
  kFloat8E8M0FNU = 44, kFloat4E2M1FNx2 = 45,
};
constexpr int32_t kDeviceCpu = 0;
constexpr int32_t kDeviceCuda = 1;
constexpr int kMaxDevices = 64;
constexpr int64_t kInlineDims = 6;

thread_local std::string last_error;

Status fail(const char *format, ...) __attribute__((format(printf, 1, 2)));
Status fail(const char *format, ...) {
  char buffer[512];
  va_list arguments;
  va_start(arguments, format);
  vsnprintf(buffer, sizeof buffer, format, arguments);
  va_end(arguments);
  last_error = buffer;
  if (getenv("CUDA_RUNNER_SHIM_TRACE")) fprintf(stderr, "cuda-runner shim: %s\n", buffer);
  return kFailure;
}

size_t element_size(int32_t dtype) {
  switch (dtype) {
    case kUInt8: case kInt8: case kBool: case kFloat8E5M2: case kFloat8E4M3FN: case kFloat8E5M2FNUZ:
    case kFloat8E4M3FNUZ: case kFloat8E8M0FNU: case kFloat4E2M1FNx2:
      return 1;
    case kInt16: case kFloat16: case kBFloat16: case kUInt16:
      return 2;
    case kInt32: case kFloat32: case kComplex32: case kUInt32:
      return 4;
    case kInt64: case kFloat64: case kComplex64: case kUInt64:
      return 8;
    case kComplex128:
      return 16;
    default:
      return 0;
  }
}

// ---------------------------------------------------------------- CUDA driver
typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUmemPoolHandle_st *CUmemoryPool;
typedef unsigned long long CUdeviceptr;
typedef struct CUfunc_st *CUfunction;
constexpr int kReleaseThreshold = 4;  // CU_MEMPOOL_ATTR_RELEASE_THRESHOLD

// cuLaunchKernelEx's arguments, laid out as cuda.h lays out CUlaunchAttribute
// and CUlaunchConfig (this file builds without the CUDA headers).
constexpr int kProgrammaticStreamSerialization = 6;  // CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
struct alignas(8) LaunchAttribute {
  int32_t id;
  char pad[4];
  union {
    char bytes[64];
    int32_t allowed;
  } value;
};
struct LaunchConfig {
  unsigned grid[3];
  unsigned block[3];
  unsigned shared_bytes;
  CUstream stream;
  LaunchAttribute *attributes;
  unsigned attribute_count;
};
static_assert(sizeof(LaunchAttribute) == 72 && sizeof(LaunchConfig) == 56, "the driver's launch structures");

struct Driver {
  bool loaded = false;
  std::string error;
  CUresult (*cuInit)(unsigned);
  CUresult (*cuDeviceGet)(CUdevice *, int);
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext *, CUdevice);
  CUresult (*cuCtxGetCurrent)(CUcontext *);
  CUresult (*cuCtxSetCurrent)(CUcontext);
  CUresult (*cuCtxGetDevice)(CUdevice *);
  CUresult (*cuMemAllocAsync)(CUdeviceptr *, size_t, CUstream);
  CUresult (*cuMemFreeAsync)(CUdeviceptr, CUstream);
  CUresult (*cuStreamCreate)(CUstream *, unsigned);
  CUresult (*cuStreamDestroy)(CUstream);
  CUresult (*cuMemcpyAsync)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
  CUresult (*cuMemsetD8Async)(CUdeviceptr, unsigned char, size_t, CUstream);
  CUresult (*cuStreamSynchronize)(CUstream);
  CUresult (*cuCtxSynchronize)();
  CUresult (*cuDeviceGetDefaultMemPool)(CUmemoryPool *, CUdevice);
  CUresult (*cuMemPoolSetAttribute)(CUmemoryPool, int, void *);
  CUresult (*cuGetErrorString)(CUresult, const char **);
  CUresult (*cuLaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream, void **,
                             void **);
  // Optional (CUDA 12.3 and later drivers): programmatic dependent launch, see crLaunchKernel.
  CUresult (*cuLaunchKernelEx)(const struct LaunchConfig *, CUfunction, void **, void **) = nullptr;
  CUresult (*cuFuncGetName)(const char **, CUfunction) = nullptr;
  CUcontext primary[kMaxDevices] = {};
};

Driver driver;
pthread_once_t driver_once = PTHREAD_ONCE_INIT;

template <typename Function>
bool bind(void *library, const char *name, Function *slot) {
  *slot = reinterpret_cast<Function>(dlsym(library, name));
  if (*slot == nullptr) driver.error = std::string("libcuda.so.1 lacks ") + name;
  return *slot != nullptr;
}

void load_driver() {
  void *library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) {
    const char *why = dlerror();
    driver.error = std::string("cannot load libcuda.so.1: ") + (why ? why : "unknown error");
    return;
  }
  bool ok = bind(library, "cuInit", &driver.cuInit) && bind(library, "cuDeviceGet", &driver.cuDeviceGet) &&
            bind(library, "cuDevicePrimaryCtxRetain", &driver.cuDevicePrimaryCtxRetain) &&
            bind(library, "cuCtxGetCurrent", &driver.cuCtxGetCurrent) &&
            bind(library, "cuCtxSetCurrent", &driver.cuCtxSetCurrent) &&
            bind(library, "cuCtxGetDevice", &driver.cuCtxGetDevice) &&
            bind(library, "cuMemAllocAsync", &driver.cuMemAllocAsync) &&
            bind(library, "cuMemFreeAsync", &driver.cuMemFreeAsync) &&
            bind(library, "cuStreamCreate", &driver.cuStreamCreate) && bind(library, "cuStreamDestroy_v2", &driver.cuStreamDestroy) &&
            bind(library, "cuMemcpyAsync", &driver.cuMemcpyAsync) &&
            bind(library, "cuMemsetD8Async", &driver.cuMemsetD8Async) &&
            bind(library, "cuStreamSynchronize", &driver.cuStreamSynchronize) &&
            bind(library, "cuCtxSynchronize", &driver.cuCtxSynchronize) &&
            bind(library, "cuDeviceGetDefaultMemPool", &driver.cuDeviceGetDefaultMemPool) &&
            bind(library, "cuMemPoolSetAttribute", &driver.cuMemPoolSetAttribute) &&
            bind(library, "cuGetErrorString", &driver.cuGetErrorString) && bind(library, "cuLaunchKernel", &driver.cuLaunchKernel);
  driver.cuLaunchKernelEx = reinterpret_cast<decltype(driver.cuLaunchKernelEx)>(dlsym(library, "cuLaunchKernelEx"));
  driver.cuFuncGetName = reinterpret_cast<decltype(driver.cuFuncGetName)>(dlsym(library, "cuFuncGetName"));
  if (ok && driver.cuInit(0) != 0) {
    driver.error = "cuInit failed: no usable CUDA driver or device";
    ok = false;
  }
  driver.loaded = ok;
}

Status cuda_failure(CUresult result, const char *what) {
  const char *text = nullptr;
  if (driver.cuGetErrorString == nullptr || driver.cuGetErrorString(result, &text) != 0 || text == nullptr) text = "unknown error";
  return fail("%s failed: CUDA error %d (%s)", what, result, text);
}

#define CU(call, what)                                  \
  do {                                                  \
    CUresult cu_result_ = (call);                       \
    if (cu_result_ != 0) return cuda_failure(cu_result_, what); \
  } while (0)

std::mutex primary_lock;

// Make the device's primary context current on this thread (the context the
// CUDA runtime, and so the model library and CuPy, use), once per thread.
Status use_device(int32_t index) {
  pthread_once(&driver_once, load_driver);
  if (!driver.loaded) return fail("%s", driver.error.c_str());
  if (index < 0 || index >= kMaxDevices) return fail("CUDA device index %d is out of range", index);
  CUcontext current = nullptr;
  CU(driver.cuCtxGetCurrent(&current), "cuCtxGetCurrent");
  CUcontext wanted;
  {
    std::lock_guard<std::mutex> hold(primary_lock);
    if (driver.primary[index] == nullptr) {
      CUdevice device;
      CU(driver.cuDeviceGet(&device, index), "cuDeviceGet");
      CUcontext context;
      CU(driver.cuDevicePrimaryCtxRetain(&context, device), "cuDevicePrimaryCtxRetain");
      // Keep freed blocks in the device's pool between calls instead of
      // returning them to the driver at every synchronisation.
      CUmemoryPool pool;
      if (driver.cuDeviceGetDefaultMemPool(&pool, device) == 0) {
        uint64_t keep = UINT64_MAX;
        driver.cuMemPoolSetAttribute(pool, kReleaseThreshold, &keep);
      }
      driver.primary[index] = context;
    }
    wanted = driver.primary[index];
  }
  if (current != wanted) CU(driver.cuCtxSetCurrent(wanted), "cuCtxSetCurrent");
  return kOk;
}

// Switches this thread to a device's context for one operation and back, so
// that freeing or allocating on another device never leaves the caller (CuPy,
// the CUDA runtime) on a context it did not choose.
class DeviceScope {
 public:
  explicit DeviceScope(int32_t index) {
    pthread_once(&driver_once, load_driver);
    if (driver.loaded && driver.cuCtxGetCurrent(&saved_) != 0) saved_ = nullptr;
    status_ = use_device(index);
  }
  ~DeviceScope() {
    CUcontext now = nullptr;
    if (driver.loaded && saved_ != nullptr && driver.cuCtxGetCurrent(&now) == 0 && now != saved_) driver.cuCtxSetCurrent(saved_);
  }
  Status status() const { return status_; }

 private:
  CUcontext saved_ = nullptr;
  Status status_ = kFailure;
};

// The current stream, per thread and device, as the generated code sets it
// through the stream guards. nullptr is the legacy default stream.
thread_local CUstream current_stream[kMaxDevices] = {};
thread_local int32_t current_device = 0;

CUstream stream_for(int32_t device) { return device >= 0 && device < kMaxDevices ? current_stream[device] : nullptr; }

// ---------------------------------------------------------------- kernel launches
// A library bound to this shim launches its kernels here (runtime/providers.py
// renames its cuLaunchKernel import). A kernel whose name holds
// kProgrammaticMark where programmatic_name looks for it waits for the launch before it to finish before it reads
// anything a step writes (cuda-runner's own kernels, compile/matvec_kernel.py,
// whose names start with it; Inductor's, which compile/inductor_pdl.py marks
// inside the name where every access of the kernel waits), so it is launched
// as a programmatic dependent: its programs may start, and load their weights,
// while that launch drains. Any other kernel is launched as cuLaunchKernel
// would. CUDA_RUNNER_PDL=0, a driver without cuLaunchKernelEx or cuFuncGetName,
// or a GPU that refuses the launch, launches every kernel plainly; the
// waits are then no-ops.
constexpr char kProgrammaticMark[] = "cudarunner_pdl_";

std::atomic<bool> programmatic_refused{false};
std::atomic<int64_t> programmatic_launches{0};

bool programmatic_wanted() {
  static const bool wanted = [] {
    const char *setting = getenv("CUDA_RUNNER_PDL");
    return setting == nullptr || strcmp(setting, "0") != 0;
  }();
  return wanted && !programmatic_refused.load(std::memory_order_relaxed) && driver.cuLaunchKernelEx != nullptr &&
         driver.cuFuncGetName != nullptr;
}

// cuda-runner's own kernels start with the mark; Inductor's, where compile/inductor_pdl.py
// marked them, carry it right after Inductor's "triton_" and three-letter kind
// ("triton_poi_cudarunner_pdl_fused_..."). Nowhere else: a name the user chose
// (a custom op's, a model's) holding the mark must not make a kernel without waits
// a programmatic dependent.
bool programmatic_name(const char *name) {
  const size_t mark = sizeof(kProgrammaticMark) - 1;
  if (strncmp(name, kProgrammaticMark, mark) == 0) return true;
  return strncmp(name, "triton_", 7) == 0 && strlen(name) > 11 && name[10] == '_' && strncmp(name + 11, kProgrammaticMark, mark) == 0;
}

// Asked at every launch, not kept: a module unloaded and another loaded may
// give a function of another name the same handle. The driver answers from
// its own tables, and a CUDA graph replays its launches without asking.
bool is_programmatic(CUfunction function) {
  const char *name = nullptr;
  return driver.cuFuncGetName(&name, function) == 0 && name != nullptr && programmatic_name(name);
}

}  // namespace

EXPORT CUresult crLaunchKernel(CUfunction function, unsigned grid_x, unsigned grid_y, unsigned grid_z, unsigned block_x,
                               unsigned block_y, unsigned block_z, unsigned shared_bytes, CUstream stream, void **arguments,
                               void **extra) {
  pthread_once(&driver_once, load_driver);
  if (!driver.loaded) return 3;  // CUDA_ERROR_NOT_INITIALIZED
  if (extra == nullptr && programmatic_wanted() && is_programmatic(function)) {
    LaunchAttribute attribute{};
    attribute.id = kProgrammaticStreamSerialization;
    attribute.value.allowed = 1;
    LaunchConfig config{{grid_x, grid_y, grid_z}, {block_x, block_y, block_z}, shared_bytes, stream, &attribute, 1};
    CUresult result = driver.cuLaunchKernelEx(&config, function, arguments, nullptr);
    if (result == 0) programmatic_launches.fetch_add(1, std::memory_order_relaxed);
    // CUDA_ERROR_INVALID_VALUE (1) or CUDA_ERROR_NOT_SUPPORTED (801) may say that this GPU or driver takes
    // no such launch: launched plainly, and if that works, never asked again.
    if (result != 1 && result != 801) return result;
    result = driver.cuLaunchKernel(function, grid_x, grid_y, grid_z, block_x, block_y, block_z, shared_bytes, stream, arguments, extra);
    if (result == 0) programmatic_refused.store(true, std::memory_order_relaxed);
    return result;
  }
  return driver.cuLaunchKernel(function, grid_x, grid_y, grid_z, block_x, block_y, block_z, shared_bytes, stream, arguments, extra);
}

namespace {

// ---------------------------------------------------------------- tensors
struct Storage {
  std::atomic<int64_t> references{1};
  void *data = nullptr;
  size_t bytes = 0;
  int32_t device_type = kDeviceCpu;
  int32_t device_index = 0;
  bool owning = false;
  CUstream stream = nullptr;  // where CUDA memory was allocated, for a free outside any stream guard
  struct Arena *arena = nullptr;  // the graph arena the memory came from (see Arena), which takes it back
};

struct Group;

struct Tensor {
  Storage *storage = nullptr;
  int64_t offset = 0;  // in elements
  int64_t dim = 0;
  int32_t dtype = kFloat32;
  int64_t *sizes = inline_dims;
  int64_t *strides = inline_dims + kInlineDims;
  int64_t inline_dims[2 * kInlineDims];
  Group *group = nullptr;  // made while a capture was open (see Group)
};

// ---------------------------------------------------------------- graph arenas
// While a CUDA graph is captured, every stream-ordered allocation becomes a
// memory node of the graph, and so does every free: a decode step of a 1B
// decoder captured 41 allocations and 40 frees beside its 98 kernels. Each
// node is a step the replay walks, and a kernel after one is no longer the
// direct successor of the kernel before it, so the two cannot overlap as
// programmatic dependents. An arena serving the capturing thread hands out
// the capture's device memory from chunks it holds instead, and the graph
// keeps only its kernels and copies.
//
// A block freed during the capture goes back to the arena at once and may be
// handed to a later request of the capture, as the stream-ordered allocator
// would reuse it on a single stream: the free comes after every kernel queued
// so far, the reuse before every kernel queued later. A programmatic
// dependent may start before the kernel ahead of it ends, but the kernels
// launched that way (crLaunchKernel) read before their wait only constants
// and step inputs no launch writes (the attention's position, in a buffer
// taken for the whole replay), and write nothing before it, so a reused
// block is never touched early.
// Graphs of one method may share an arena: they replay one at a time on one
// stream, and what one hands back (its outputs) stays taken.
//
// Chunks come from the stream-ordered pool on the arena's own stream, not
// from cuMemAlloc and cuMemFree, which synchronise and would end a capture
// another thread has open; the stream is synchronised when a capture stops
// being served, before any replay can read the chunks. Blocks are split from
// the smallest idle block that fits and merged with idle neighbours when
// given back, so a step's mixed sizes share memory. The arena lives as long
// as its owner's hold and every storage that holds one of its blocks.
struct Arena {
  struct Block {
    size_t size;
    size_t chunk;  // which chunk: blocks merge only within one
    bool idle;
  };
  std::atomic<int64_t> references{1};
  int32_t device_index = 0;
  CUstream stream = nullptr;  // the arena's own, for its chunks' allocation and free
  std::mutex lock;
  std::vector<CUdeviceptr> chunks;
  std::map<CUdeviceptr, Block> blocks;      // every block, by address
  std::multimap<size_t, CUdeviceptr> idle;  // the idle ones, by size
  size_t reserved = 0;                      // bytes in chunks
};

constexpr size_t kArenaAlignment = 256;          // as cuMemAllocAsync aligns
constexpr size_t kArenaChunk = size_t{8} << 20;  // the least a chunk holds

thread_local Arena *serving_arena = nullptr;

void drop_arena(Arena *arena) {
  if (arena->references.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  DeviceScope scope(arena->device_index);
  if (scope.status() == kOk && arena->stream != nullptr) {
    // Queued on the arena's stream, behind nothing of the graph's: the graph's
    // owner lets go only once its stream is idle. Neither call waits.
    for (CUdeviceptr chunk : arena->chunks) driver.cuMemFreeAsync(chunk, arena->stream);
    driver.cuStreamDestroy(arena->stream);
  }
  delete arena;
}

void mark_idle(Arena *arena, CUdeviceptr address, Arena::Block &block) {
  block.idle = true;
  arena->idle.emplace(block.size, address);
}

void unmark_idle(Arena *arena, CUdeviceptr address, Arena::Block &block) {
  auto [first, last] = arena->idle.equal_range(block.size);
  for (auto it = first; it != last; ++it) {
    if (it->second == address) {
      arena->idle.erase(it);
      break;
    }
  }
  block.idle = false;
}

// A block of at least `bytes` from the arena, or kFailure. The caller holds the
// DeviceScope and the arena's lock.
Status arena_take(Arena *arena, size_t bytes, CUdeviceptr *pointer) {
  if (bytes > (size_t{1} << 62)) return fail("cannot allocate %zu bytes", bytes);
  size_t rounded = (std::max<size_t>(bytes, 1) + kArenaAlignment - 1) & ~(kArenaAlignment - 1);
  auto fit = arena->idle.lower_bound(rounded);
  if (fit == arena->idle.end()) {
    size_t size = std::max(rounded, kArenaChunk);
    CUdeviceptr base = 0;
    CU(driver.cuMemAllocAsync(&base, size, arena->stream), "cuMemAllocAsync (graph arena)");
    arena->chunks.push_back(base);
    arena->reserved += size;
    Arena::Block &block = arena->blocks[base] = {size, arena->chunks.size() - 1, false};
    mark_idle(arena, base, block);
    fit = arena->idle.find(size);
    while (fit->second != base) ++fit;
  }
  CUdeviceptr address = fit->second;
  Arena::Block &block = arena->blocks[address];
  unmark_idle(arena, address, block);
  if (block.size > rounded) {  // the rest stays idle, a block of its own
    Arena::Block &rest = arena->blocks[address + rounded] = {block.size - rounded, block.chunk, false};
    mark_idle(arena, address + rounded, rest);
    block.size = rounded;
  }
  *pointer = address;
  return kOk;
}

// A block back, merged with idle neighbours of its chunk. The caller holds the arena's lock.
void arena_put(Arena *arena, CUdeviceptr address) {
  auto it = arena->blocks.find(address);
  if (it == arena->blocks.end() || it->second.idle) return;
  auto next = std::next(it);
  if (next != arena->blocks.end() && next->second.idle && next->second.chunk == it->second.chunk && next->first == address + it->second.size) {
    unmark_idle(arena, next->first, next->second);
    it->second.size += next->second.size;
    arena->blocks.erase(next);
  }
  if (it != arena->blocks.begin()) {
    auto previous = std::prev(it);
    if (previous->second.idle && previous->second.chunk == it->second.chunk && previous->first + previous->second.size == address) {
      unmark_idle(arena, previous->first, previous->second);
      previous->second.size += it->second.size;
      arena->blocks.erase(it);
      it = previous;
    }
  }
  mark_idle(arena, it->first, it->second);
}

Status arena_allocate(Arena *arena, size_t bytes, CUdeviceptr *pointer) {
  std::lock_guard<std::mutex> hold(arena->lock);
  if (arena_take(arena, bytes, pointer) != kOk) return kFailure;
  arena->references.fetch_add(1, std::memory_order_relaxed);
  return kOk;
}

void arena_give_back(Arena *arena, CUdeviceptr pointer) {
  {
    std::lock_guard<std::mutex> hold(arena->lock);
    arena_put(arena, pointer);
  }
  drop_arena(arena);
}

std::atomic<int64_t> live_tensors{0};
std::atomic<int64_t> live_storages{0};

// Tensors made on one thread while a capture is open. The AOTInductor runtime
// takes a handle of its own (new_tensor_handle) to each constant the caller
// binds as user-managed, and never deletes it, not even when the container is
// deleted: one tensor and one storage reference per bound constant per load.
// The runtime opens a capture around the binding call and, once the container
// is gone, releases what is still alive of it. A captured tensor deleted by
// its owner leaves the group first, so nothing is freed twice, whatever a
// later torch's container does with its handles.
struct Group {
  std::vector<Tensor *> members;
};

std::mutex group_lock;
thread_local Group *capturing = nullptr;

void join_group(Tensor *tensor) {
  Group *group = capturing;
  if (group == nullptr) return;
  std::lock_guard<std::mutex> hold(group_lock);
  group->members.push_back(tensor);
  tensor->group = group;
}

void leave_group(Tensor *tensor) {
  std::lock_guard<std::mutex> hold(group_lock);
  auto &members = tensor->group->members;
  for (auto it = members.begin(); it != members.end(); ++it) {
    if (*it == tensor) {
      members.erase(it);
      break;
    }
  }
  tensor->group = nullptr;
}

Storage *new_storage() {
  Storage *storage = new (std::nothrow) Storage();
  if (storage != nullptr) live_storages.fetch_add(1, std::memory_order_relaxed);
  return storage;
}

bool valid_device(int32_t device_type) { return device_type == kDeviceCpu || device_type == kDeviceCuda; }

void release_storage(Storage *storage) {
  if (storage == nullptr || storage->references.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  if (storage->owning && storage->data != nullptr) {
    if (storage->arena != nullptr) {
      arena_give_back(storage->arena, reinterpret_cast<CUdeviceptr>(storage->data));
    } else if (storage->device_type == kDeviceCuda) {
      // Freed on the stream that is current here if a guard set one, else on
      // the stream it was allocated on: after the work that used it.
      CUstream stream = stream_for(storage->device_index);
      if (stream == nullptr) stream = storage->stream;
      CUdeviceptr pointer = reinterpret_cast<CUdeviceptr>(storage->data);
      // The allocating stream may be gone (a lane closed before an output it
      // made was dropped): then wait for all work and free on the legacy stream.
      DeviceScope scope(storage->device_index);
      if (scope.status() == kOk && driver.cuMemFreeAsync(pointer, stream) != 0 && driver.cuCtxSynchronize() == 0)
        driver.cuMemFreeAsync(pointer, nullptr);
    } else {
      free(storage->data);
    }
  }
  live_storages.fetch_sub(1, std::memory_order_relaxed);
  delete storage;
}

Tensor *new_tensor(Storage *storage, int64_t offset, int64_t dim, const int64_t *sizes, const int64_t *strides, int32_t dtype) {
  Tensor *tensor = new (std::nothrow) Tensor();
  if (tensor == nullptr) return nullptr;
  if (dim > kInlineDims) {
    tensor->sizes = new (std::nothrow) int64_t[2 * dim];
    if (tensor->sizes == nullptr) {
      delete tensor;
      return nullptr;
    }
    tensor->strides = tensor->sizes + dim;
  }
  tensor->storage = storage;
  tensor->offset = offset;
  tensor->dim = dim;
  tensor->dtype = dtype;
  if (dim > 0) {
    memcpy(tensor->sizes, sizes, sizeof(int64_t) * dim);
    memcpy(tensor->strides, strides, sizeof(int64_t) * dim);
  }
  live_tensors.fetch_add(1, std::memory_order_relaxed);
  join_group(tensor);
  return tensor;
}

void delete_tensor(Tensor *tensor) {
  if (tensor->group != nullptr) leave_group(tensor);
  release_storage(tensor->storage);
  if (tensor->sizes != tensor->inline_dims) delete[] tensor->sizes;
  live_tensors.fetch_sub(1, std::memory_order_relaxed);
  delete tensor;
}

Tensor *as_tensor(void *handle) { return static_cast<Tensor *>(handle); }

// The element count, saturated at INT64_MAX: a broadcast view (zero strides)
// may have more elements than any memory, though it addresses few.
int64_t numel_of(int64_t dim, const int64_t *sizes) {
  int64_t count = 1;
  for (int64_t d = 0; d < dim; ++d) {
    if (sizes[d] == 0) return 0;
    if (__builtin_mul_overflow(count, sizes[d], &count)) count = INT64_MAX;
  }
  return count;
}

// Whether no two elements of this layout share memory: dims sorted by
// stride, each stride must step past everything the smaller ones address.
// Dims of size 1 address nothing new; a dim of stride 0 and size above 1 overlaps.
bool non_overlapping(int64_t dim, const int64_t *sizes, const int64_t *strides) {
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size)
  for (int64_t d = 0; d < dim; ++d) {
    if (sizes[d] == 0) return true;
    if (sizes[d] != 1) dims.emplace_back(strides[d], sizes[d]);
  }
  std::sort(dims.begin(), dims.end());
  int64_t reach = 0;  // elements addressed by the dims so far, from the first
  for (auto [stride, size] : dims) {
    if (stride <= reach) return false;
    int64_t step;
    if (__builtin_mul_overflow(size - 1, stride, &step) || __builtin_add_overflow(reach, step, &reach)) return false;
  }
  return true;
}

bool non_overlapping(const Tensor *tensor) { return non_overlapping(tensor->dim, tensor->sizes, tensor->strides); }

// Elements from the first one addressed to one past the last; 0 when empty.
// False for negative sizes or strides, or a span that overflows.
bool span_of(int64_t dim, const int64_t *sizes, const int64_t *strides, int64_t *span) {
  for (int64_t d = 0; d < dim; ++d) {
    if (sizes[d] < 0 || strides[d] < 0) return false;
    if (sizes[d] == 0) {
      *span = 0;
      return true;
    }
  }
  int64_t extent = 0;
  for (int64_t d = 0; d < dim; ++d) {
    int64_t step;
    if (__builtin_mul_overflow(sizes[d] - 1, strides[d], &step) || __builtin_add_overflow(extent, step, &extent)) return false;
  }
  *span = extent + 1;
  return true;
}

bool is_contiguous(const Tensor *tensor) {
  int64_t expected = 1;
  for (int64_t d = tensor->dim - 1; d >= 0; --d) {
    if (tensor->sizes[d] == 1) continue;
    if (tensor->strides[d] != expected) return false;
    expected *= tensor->sizes[d];
  }
  return true;
}

char *data_of(const Tensor *tensor) {
  if (tensor->storage == nullptr || tensor->storage->data == nullptr) return nullptr;
  return static_cast<char *>(tensor->storage->data) + tensor->offset * static_cast<int64_t>(element_size(tensor->dtype));
}

// The bytes a tensor's elements occupy, from its first to one past its last; false when it has none.
bool byte_range(const Tensor *tensor, uintptr_t *begin, uintptr_t *end) {
  int64_t span = 0;
  if (data_of(tensor) == nullptr || !span_of(tensor->dim, tensor->sizes, tensor->strides, &span) || span == 0) return false;
  *begin = reinterpret_cast<uintptr_t>(data_of(tensor));
  *end = *begin + static_cast<uintptr_t>(span) * element_size(tensor->dtype);
  return true;
}

// Whether two tensors' element bytes meet (on one device: addresses of two devices never compare).
bool ranges_meet(const Tensor *a, const Tensor *b) {
  uintptr_t a_begin, a_end, b_begin, b_end;
  if (!byte_range(a, &a_begin, &a_end) || !byte_range(b, &b_begin, &b_end)) return false;
  int32_t a_device = a->storage ? a->storage->device_type : kDeviceCpu, b_device = b->storage ? b->storage->device_type : kDeviceCpu;
  if (a_device != b_device) return false;
  return a_begin < b_end && b_begin < a_end;
}

Status check_shape(int64_t dim, const int64_t *sizes, const int64_t *strides) {
  if (dim < 0 || dim > 64) return fail("a tensor of %lld dims is not supported", static_cast<long long>(dim));
  if (dim > 0 && (sizes == nullptr || strides == nullptr)) return fail("a tensor's sizes or strides are missing");
  return kOk;
}

Status allocate(int32_t device_type, int32_t device_index, size_t bytes, Storage **result) {
  Storage *storage = new_storage();
  if (storage == nullptr) return fail("out of host memory");
  storage->device_type = device_type;
  storage->device_index = device_type == kDeviceCuda ? device_index : 0;
  storage->bytes = bytes;
  storage->owning = true;
  if (bytes > 0) {
    if (device_type == kDeviceCuda) {
      DeviceScope scope(device_index);
      if (scope.status() != kOk) {
        release_storage(storage);
        return kFailure;
      }
      CUdeviceptr pointer = 0;
      storage->stream = stream_for(device_index);
      Arena *arena = serving_arena;
      if (arena != nullptr && arena->device_index == device_index) {
        if (arena_allocate(arena, bytes, &pointer) != kOk) {
          release_storage(storage);
          return kFailure;
        }
        storage->arena = arena;
      } else {
        CUresult result_code = driver.cuMemAllocAsync(&pointer, bytes, storage->stream);
        if (result_code != 0) {
          release_storage(storage);
          return cuda_failure(result_code, "cuMemAllocAsync");
        }
      }
      storage->data = reinterpret_cast<void *>(pointer);
    } else {
      // 64-byte aligned, as vectorised CPU kernels expect.
      size_t rounded = (bytes + 63) & ~static_cast<size_t>(63);
      storage->data = aligned_alloc(64, rounded);
      if (storage->data == nullptr) {
        release_storage(storage);
        return fail("out of host memory allocating %zu bytes", bytes);
      }
    }
  }
  *result = storage;
  return kOk;
}

Status new_empty(int64_t dim, const int64_t *sizes, const int64_t *strides, int32_t dtype, int32_t device_type, int32_t device_index,
                 Tensor **result) {
  if (check_shape(dim, sizes, strides) != kOk) return kFailure;
  size_t size = element_size(dtype);
  if (size == 0) return fail("dtype code %d is not supported", dtype);
  if (!valid_device(device_type)) return fail("device type %d is not supported (CPU and CUDA only)", device_type);
  int64_t span = 0;
  if (!span_of(dim, sizes, strides, &span)) return fail("a tensor's sizes and strides overflow or are negative");
  size_t bytes;
  if (__builtin_mul_overflow(static_cast<size_t>(span), size, &bytes)) return fail("a tensor's size overflows");
  Storage *storage = nullptr;
  if (allocate(device_type, device_index, bytes, &storage) != kOk) return kFailure;
  Tensor *tensor = new_tensor(storage, 0, dim, sizes, strides, dtype);
  if (tensor == nullptr) {
    release_storage(storage);
    return fail("out of host memory");
  }
  *result = tensor;
  return kOk;
}

// ---------------------------------------------------------------- copies
// Host-side strided copy of elements of one size, any strides, broadcasting
// nothing: both tensors have the same sizes.
void strided_copy(char *destination, const int64_t *destination_strides, const char *source, const int64_t *source_strides,
                  const int64_t *sizes, int64_t dim, size_t size) {
  if (dim == 0) {
    memcpy(destination, source, size);
    return;
  }
  std::vector<int64_t> index(dim, 0);
  int64_t count = numel_of(dim, sizes);
  for (int64_t n = 0; n < count; ++n) {
    int64_t to = 0, from = 0;
    for (int64_t d = 0; d < dim; ++d) {
      to += index[d] * destination_strides[d];
      from += index[d] * source_strides[d];
    }
    memcpy(destination + to * static_cast<int64_t>(size), source + from * static_cast<int64_t>(size), size);
    for (int64_t d = dim - 1; d >= 0; --d) {
      if (++index[d] < sizes[d]) break;
      index[d] = 0;
    }
  }
}

bool same_layout(const Tensor *a, const Tensor *b) {
  if (a->dim != b->dim) return false;
  for (int64_t d = 0; d < a->dim; ++d)
    if (a->sizes[d] != b->sizes[d] || (a->sizes[d] != 1 && a->strides[d] != b->strides[d])) return false;
  return true;
}

int32_t device_of(const Tensor *tensor) { return tensor->storage ? tensor->storage->device_type : kDeviceCpu; }

// Whole-span bytes of a tensor, for the bulk copy paths.
size_t span_bytes(const Tensor *tensor) {
  int64_t span = 0;
  span_of(tensor->dim, tensor->sizes, tensor->strides, &span);
  return static_cast<size_t>(span) * element_size(tensor->dtype);
}

Status copy_bytes(void *destination, int32_t destination_device, const void *source, int32_t source_device, size_t bytes, int32_t device_index,
                  bool wait) {
  if (bytes == 0) return kOk;
  if (destination_device == kDeviceCpu && source_device == kDeviceCpu) {
    memmove(destination, source, bytes);
    return kOk;
  }
  DeviceScope scope(device_index);
  if (scope.status() != kOk) return kFailure;
  CUstream stream = stream_for(device_index);
  CU(driver.cuMemcpyAsync(reinterpret_cast<CUdeviceptr>(destination), reinterpret_cast<CUdeviceptr>(source), bytes, stream), "cuMemcpyAsync");
  // A copy that touches host memory is finished before returning: the caller
  // may read or free that memory next.
  if (wait || destination_device == kDeviceCpu || source_device == kDeviceCpu) CU(driver.cuStreamSynchronize(stream), "cuStreamSynchronize");
  return kOk;
}

// A tensor made by new_uninitialized_tensor has no storage: using its data is an error, not a crash.
Status require_data(const Tensor *tensor) {
  if (numel_of(tensor->dim, tensor->sizes) > 0 && data_of(tensor) == nullptr) return fail("a tensor without data (undefined) was used");
  return kOk;
}

Status copy_into(Tensor *destination, const Tensor *source) {
  if (require_data(destination) != kOk || require_data(source) != kOk) return kFailure;
  if (destination->dtype != source->dtype)
    return fail("copy between dtypes %d and %d is not supported by this shim", source->dtype, destination->dtype);
  if (destination->dim != source->dim) return fail("copy between tensors of %lld and %lld dims", (long long)source->dim, (long long)destination->dim);
  for (int64_t d = 0; d < source->dim; ++d)
    if (destination->sizes[d] != source->sizes[d]) return fail("copy between tensors of different sizes");
  if (numel_of(source->dim, source->sizes) == 0) return kOk;
  // As libtorch refuses them: a destination whose elements share memory, and
  // a source that partly overlaps it (read after written: wrong numbers).
  if (!non_overlapping(destination)) return fail("copy_: more than one element of the written-to tensor refers to a single memory location");
  if (ranges_meet(destination, source)) {
    if (data_of(destination) == data_of(source) && same_layout(destination, source)) return kOk;  // a copy onto itself
    return fail("copy_: the source and the destination overlap in memory");
  }
  size_t size = element_size(source->dtype);
  int32_t to_device = device_of(destination), from_device = device_of(source);
  int32_t index = to_device == kDeviceCuda ? destination->storage->device_index : from_device == kDeviceCuda ? source->storage->device_index : 0;
  if (same_layout(destination, source) && (is_contiguous(source) || (to_device == kDeviceCpu && from_device == kDeviceCpu))) {
    if (is_contiguous(source))
      return copy_bytes(data_of(destination), to_device, data_of(source), from_device, numel_of(source->dim, source->sizes) * size, index, false);
  }
  if (to_device == kDeviceCpu && from_device == kDeviceCpu) {
    strided_copy(data_of(destination), destination->strides, data_of(source), source->strides, source->sizes, source->dim, size);
    return kOk;
  }
  // A strided copy that involves the GPU goes through host memory: rare in
  // generated code (buffer mutations are contiguous), and correct.
  int64_t from_span = 0, to_span = 0;
  if (!span_of(source->dim, source->sizes, source->strides, &from_span) || !span_of(destination->dim, destination->sizes, destination->strides, &to_span))
    return fail("copy: negative strides are not supported");
  size_t from_bytes = span_bytes(source), to_bytes = span_bytes(destination);
  std::vector<char> from(from_bytes), to(to_bytes);
  if (copy_bytes(from.data(), kDeviceCpu, data_of(source), from_device, from_bytes, index, true) != kOk) return kFailure;
  if (copy_bytes(to.data(), kDeviceCpu, data_of(destination), to_device, to_bytes, index, true) != kOk) return kFailure;
  strided_copy(to.data(), destination->strides, from.data(), source->strides, source->sizes, source->dim, size);
  return copy_bytes(data_of(destination), to_device, to.data(), kDeviceCpu, to_bytes, index, true);
}

// ---------------------------------------------------------------- CPU matmul
// Tensors as the kernels of cpu_kernels.cpp take them.
bool gemm_element(int32_t dtype, cr::Element *element) {
  switch (dtype) {
    case kFloat32: *element = cr::Element::kFloat32; return true;
    case kFloat64: *element = cr::Element::kFloat64; return true;
    case kFloat16: *element = cr::Element::kFloat16; return true;
    case kBFloat16: *element = cr::Element::kBFloat16; return true;
    default: return false;
  }
}

cr::Matrix matrix_of(const Tensor *tensor) {
  return cr::Matrix{data_of(tensor), tensor->sizes[0], tensor->sizes[1], tensor->strides[0], tensor->strides[1]};
}

// out = beta * self + alpha * (a @ b): self (a bias [n], [1, n], or [m, n]) is
// broadcast into out first, then the GEMM scales it by beta.
Status cpu_addmm(Tensor *out, const Tensor *self, const Tensor *a, const Tensor *b, double beta, double alpha) {
  if (a->dim != 2 || b->dim != 2 || out->dim != 2) return fail("addmm/mm needs 2-D matrices");
  for (const Tensor *matrix : {static_cast<const Tensor *>(out), a, b}) if (require_data(matrix) != kOk) return kFailure;
  if (self != nullptr && require_data(self) != kOk) return kFailure;
  // out is written while a, b and self are read: they may not share its memory
  // (self may be out itself, which is read before it is written).
  if (!non_overlapping(out)) return fail("addmm/mm: more than one element of out refers to a single memory location");
  if (ranges_meet(out, a) || ranges_meet(out, b)) return fail("addmm/mm: out overlaps an input matrix in memory");
  if (self != nullptr && ranges_meet(out, self) && !(data_of(out) == data_of(self) && same_layout(out, self)))
    return fail("addmm: out overlaps the added matrix in memory");
  int64_t m = a->sizes[0], k = a->sizes[1], n = b->sizes[1];
  if (b->sizes[0] != k || out->sizes[0] != m || out->sizes[1] != n) return fail("addmm/mm: matrix sizes do not match");
  if (a->dtype != b->dtype || out->dtype != a->dtype || (self != nullptr && self->dtype != a->dtype)) return fail("addmm/mm: mixed dtypes");
  if (device_of(out) != kDeviceCpu || device_of(a) != kDeviceCpu || device_of(b) != kDeviceCpu || (self != nullptr && device_of(self) != kDeviceCpu))
    return fail("cpu addmm/mm got a CUDA tensor");
  cr::Element element;
  if (!gemm_element(a->dtype, &element))
    return fail("cpu addmm/mm computes float32, float64, float16 and bfloat16, not dtype code %d", a->dtype);
  bool adds = self != nullptr && beta != 0;
  if (adds && data_of(self) != data_of(out)) {
    // self broadcast to [m, n]: a bias [n] or [1, n], or a full matrix.
    int64_t strides[2] = {0, 0};
    if (self->dim == 1 && self->sizes[0] == n) {
      strides[1] = self->strides[0];
    } else if (self->dim == 2 && (self->sizes[0] == m || self->sizes[0] == 1) && (self->sizes[1] == n || self->sizes[1] == 1)) {
      strides[0] = self->sizes[0] == 1 ? 0 : self->strides[0];
      strides[1] = self->sizes[1] == 1 ? 0 : self->strides[1];
    } else {
      return fail("addmm: the added matrix does not broadcast to the result");
    }
    size_t size = element_size(a->dtype);
    const char *from = data_of(self);
    char *to = data_of(out);
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j)
        memcpy(to + (i * out->strides[0] + j * out->strides[1]) * static_cast<int64_t>(size), from + (i * strides[0] + j * strides[1]) * static_cast<int64_t>(size), size);
  }
  std::string error;
  if (!cr::gemm(element, matrix_of(out), matrix_of(a), matrix_of(b), alpha, adds ? beta : 0.0, &error)) return fail("addmm/mm: %s", error.c_str());
  return kOk;
}

struct StreamGuard {
  int32_t device;
  CUstream previous_stream;
  int32_t previous_device;
  CUcontext previous_context;
};

struct DeviceGuard {
  int32_t previous_device;
  CUcontext previous_context;
};

// The context current on this thread before a guard switched it, restored
// when the guard goes (libtorch's guards restore the device they found).
CUcontext current_context() {
  CUcontext context = nullptr;
  if (driver.loaded && driver.cuCtxGetCurrent(&context) != 0) context = nullptr;
  return context;
}

void restore_context(CUcontext context) {
  CUcontext now = current_context();
  if (context != nullptr && now != context) driver.cuCtxSetCurrent(context);
}

thread_local bool grad_enabled = false;

template <typename T>
Status read_item(void *handle, T *result, int32_t dtype) {
  Tensor *tensor = as_tensor(handle);
  if (tensor == nullptr || result == nullptr) return fail("item: null argument");
  if (tensor->dtype != dtype) return fail("item: the tensor's dtype is code %d, not %d", tensor->dtype, dtype);
  if (numel_of(tensor->dim, tensor->sizes) != 1) return fail("item: the tensor has more than one element");
  if (require_data(tensor) != kOk) return kFailure;
  int32_t device = device_of(tensor);
  return copy_bytes(result, kDeviceCpu, data_of(tensor), device, sizeof(T), device == kDeviceCuda ? tensor->storage->device_index : 0, true);
}

}  // namespace

#define GUARD_NULL(pointer)                                                      \
  do {                                                                           \
    if ((pointer) == nullptr) return fail("%s: null argument " #pointer, __func__); \
  } while (0)

// ---------------------------------------------------------------- codes
#define CODE(name, value) \
  EXPORT int32_t cudarunner_##name() { return value; }
CODE(device_type_cpu, kDeviceCpu)
CODE(device_type_cuda, kDeviceCuda)
CODE(device_type_meta, 14)
CODE(device_type_xpu, 12)
CODE(device_type_mps, 13)
CODE(device_type_privateuse1, 20)
CODE(dtype_float8_e5m2, kFloat8E5M2)
CODE(dtype_float8_e4m3fn, kFloat8E4M3FN)
CODE(dtype_float8_e5m2fnuz, kFloat8E5M2FNUZ)
CODE(dtype_float8_e4m3fnuz, kFloat8E4M3FNUZ)
CODE(dtype_float8_e8m0fnu, kFloat8E8M0FNU)
CODE(dtype_float4_e2m1fn_x2, kFloat4E2M1FNx2)
CODE(dtype_bfloat16, kBFloat16)
CODE(dtype_float16, kFloat16)
CODE(dtype_float32, kFloat32)
CODE(dtype_float64, kFloat64)
CODE(dtype_uint8, kUInt8)
CODE(dtype_uint16, kUInt16)
CODE(dtype_uint32, kUInt32)
CODE(dtype_uint64, kUInt64)
CODE(dtype_int8, kInt8)
CODE(dtype_int16, kInt16)
CODE(dtype_int32, kInt32)
CODE(dtype_int64, kInt64)
CODE(dtype_bool, kBool)
CODE(dtype_complex32, kComplex32)
CODE(dtype_complex64, kComplex64)
CODE(dtype_complex128, kComplex128)
CODE(layout_strided, 0)
CODE(memory_format_contiguous_format, 0)
CODE(memory_format_preserve_format, 1)
CODE(memory_format_channels_last, 2)
CODE(memory_format_channels_last_3d, 3)

EXPORT size_t cudarunner_dtype_element_size(int32_t dtype) { return element_size(dtype); }

// ---------------------------------------------------------------- our own entry points
EXPORT int32_t cudarunner_shim_abi_version() { return SHIM_ABI_VERSION; }
EXPORT const char *cudarunner_shim_last_error() { return last_error.c_str(); }
// Kernels launched as programmatic dependents so far in the process (crLaunchKernel).
EXPORT int64_t cudarunner_shim_programmatic_launches() { return programmatic_launches.load(); }
// Whether a kernel of this name is launched as a programmatic dependent (where the GPU and driver allow).
EXPORT int32_t cudarunner_shim_programmatic_name(const char *name) { return name != nullptr && programmatic_name(name); }

// A capture (see Group): begin returns it, end stops adding to it on this
// thread, release deletes every tensor of it still alive, and the group.
EXPORT void *cudarunner_shim_capture_begin() {
  Group *group = new (std::nothrow) Group();
  capturing = group;
  return group;
}
EXPORT void cudarunner_shim_capture_end(void *) { capturing = nullptr; }
EXPORT int64_t cudarunner_shim_capture_release(void *handle) {
  Group *group = static_cast<Group *>(handle);
  if (group == nullptr) return 0;
  std::vector<Tensor *> members;
  {
    std::lock_guard<std::mutex> hold(group_lock);
    members.swap(group->members);
    for (Tensor *tensor : members) tensor->group = nullptr;
  }
  for (Tensor *tensor : members) delete_tensor(tensor);
  delete group;
  return static_cast<int64_t>(members.size());
}

// Graph arenas (see Arena). new makes one for a device, with its own stream;
// serve has it hand out this thread's device memory for that device until
// stop, which also waits for its chunks to be allocated; release drops the
// maker's hold on it; bytes says how much device memory it holds.
EXPORT void *cudarunner_shim_arena_new(int32_t device_index) {
  DeviceScope scope(device_index);
  if (scope.status() != kOk) return nullptr;
  Arena *arena = new (std::nothrow) Arena();
  if (arena == nullptr) {
    fail("out of host memory");
    return nullptr;
  }
  arena->device_index = device_index;
  constexpr unsigned kNonBlocking = 1;  // CU_STREAM_NON_BLOCKING: no implicit order with the legacy stream
  CUresult result = driver.cuStreamCreate(&arena->stream, kNonBlocking);
  if (result != 0) {
    cuda_failure(result, "cuStreamCreate (graph arena)");
    delete arena;
    return nullptr;
  }
  return arena;
}
EXPORT void cudarunner_shim_arena_serve(void *handle) { serving_arena = static_cast<Arena *>(handle); }
EXPORT Status cudarunner_shim_arena_stop(void *handle) {
  Arena *arena = static_cast<Arena *>(handle);
  if (serving_arena == arena) serving_arena = nullptr;
  if (arena == nullptr) return kOk;
  DeviceScope scope(arena->device_index);
  if (scope.status() != kOk) return kFailure;
  CU(driver.cuStreamSynchronize(arena->stream), "cuStreamSynchronize (graph arena)");
  return kOk;
}
EXPORT void cudarunner_shim_arena_release(void *handle) {
  if (handle == nullptr) return;
  Arena *arena = static_cast<Arena *>(handle);
  if (serving_arena == arena) serving_arena = nullptr;
  drop_arena(arena);
}
EXPORT int64_t cudarunner_shim_arena_bytes(void *handle) {
  if (handle == nullptr) return 0;
  Arena *arena = static_cast<Arena *>(handle);
  std::lock_guard<std::mutex> hold(arena->lock);
  return static_cast<int64_t>(arena->reserved);
}

// Live tensors and storages, so that tests can check that a run leaks none.
EXPORT int64_t cudarunner_shim_live_tensors() { return live_tensors.load(); }
EXPORT int64_t cudarunner_shim_live_storages() { return live_storages.load(); }

// ---------------------------------------------------------------- grad mode, messages
EXPORT bool cudarunner_grad_mode_is_enabled() { return grad_enabled; }
EXPORT void cudarunner_grad_mode_set_enabled(bool enabled) { grad_enabled = enabled; }  // no autograd here; the flag is kept

EXPORT void cudarunner_warn(const char *function, const char *file, uint32_t line, const char *message) {
  if (getenv("CUDA_RUNNER_SHIM_TRACE")) fprintf(stderr, "cuda-runner shim: warning from %s (%s:%u): %s\n", function, file, line, message);
}

// Generated code calls this for its own checks; the container catches the
// exception and returns a failure, as with libtorch.
EXPORT void cudarunner_check(bool condition, const char *function, const char *file, uint32_t line, const char *message) {
  if (condition) return;
  fail("check failed in %s (%s:%u): %s", function ? function : "?", file ? file : "?", line, message ? message : "");
  throw std::runtime_error(last_error);
}

// ---------------------------------------------------------------- queries
EXPORT Status cudarunner_get_data_ptr(void *handle, void **result) {
  GUARD_NULL(handle);
  GUARD_NULL(result);
  *result = data_of(as_tensor(handle));
  return kOk;
}
EXPORT Status cudarunner_get_storage_size(void *handle, int64_t *result) {
  GUARD_NULL(handle);
  GUARD_NULL(result);
  Tensor *tensor = as_tensor(handle);
  *result = tensor->storage ? static_cast<int64_t>(tensor->storage->bytes) : 0;
  return kOk;
}
EXPORT Status cudarunner_get_storage_numel(void *handle, int64_t *result) {
  GUARD_NULL(handle);
  GUARD_NULL(result);
  Tensor *tensor = as_tensor(handle);
  *result = tensor->storage ? static_cast<int64_t>(tensor->storage->bytes / element_size(tensor->dtype)) : 0;
  return kOk;
}
EXPORT Status cudarunner_get_dim(void *handle, int64_t *result) {
  GUARD_NULL(handle);
  GUARD_NULL(result);
  *result = as_tensor(handle)->dim;
  return kOk;
}
EXPORT Status cudarunner_get_numel(void *handle, int64_t *result) {
  GUARD_NULL(handle);
  GUARD_NULL(result);
  *result = numel_of(as_tensor(handle)->dim, as_tensor(handle)->sizes);
  return kOk;
}
EXPORT Status cudarunner_get_sizes(void *handle, int64_t **result) {
  GUARD_NULL(handle);
  GUARD_NULL(result);
  *result = as_tensor(handle)->sizes;
  return kOk;
}
EXPORT Status cudarunner_get_strides(void *handle, int64_t **result) {
  GUARD_NULL(handle);
  GUARD_NULL(result);
  *result = as_tensor(handle)->strides;
  return kOk;
}
EXPORT Status cudarunner_get_size(void *handle, int64_t d, int64_t *result) {
  GUARD_NULL(handle);
  GUARD_NULL(result);
  Tensor *tensor = as_tensor(handle);
  if (d < 0) d += tensor->dim;
  if (d < 0 || d >= tensor->dim) return fail("get_size: dim %lld out of range", static_cast<long long>(d));
  *result = tensor->sizes[d];
  return kOk;
}
EXPORT Status cudarunner_get_stride(void *handle, int64_t d, int64_t *result) {
  GUARD_NULL(handle);
  GUARD_NULL(result);
  Tensor *tensor = as_tensor(handle);
  if (d < 0) d += tensor->dim;
  if (d < 0 || d >= tensor->dim) return fail("get_stride: dim %lld out of range", static_cast<long long>(d));
  *result = tensor->strides[d];
  return kOk;
}
EXPORT Status cudarunner_get_dtype(void *handle, int32_t *result) {
  GUARD_NULL(handle);
  GUARD_NULL(result);
  *result = as_tensor(handle)->dtype;
  return kOk;
}
EXPORT Status cudarunner_get_device_type(void *handle, int32_t *result) {
  GUARD_NULL(handle);
  GUARD_NULL(result);
  *result = device_of(as_tensor(handle));
  return kOk;
}
EXPORT Status cudarunner_get_device_index(void *handle, int32_t *result) {
  GUARD_NULL(handle);
  GUARD_NULL(result);
  Tensor *tensor = as_tensor(handle);
  *result = device_of(tensor) == kDeviceCuda ? tensor->storage->device_index : -1;
  return kOk;
}
EXPORT Status cudarunner_get_layout(void *handle, int32_t *result) {
  GUARD_NULL(handle);
  GUARD_NULL(result);
  *result = 0;
  return kOk;
}
EXPORT Status cudarunner_get_storage_offset(void *handle, int64_t *result) {
  GUARD_NULL(handle);
  GUARD_NULL(result);
  *result = as_tensor(handle)->offset;
  return kOk;
}
EXPORT Status cudarunner_is_contiguous(void *handle, bool *result) {
  GUARD_NULL(handle);
  GUARD_NULL(result);
  *result = is_contiguous(as_tensor(handle));
  return kOk;
}
EXPORT Status cudarunner_is_defined(void *handle, bool *result) {
  GUARD_NULL(result);
  *result = handle != nullptr && as_tensor(handle)->storage != nullptr;
  return kOk;
}

// ---------------------------------------------------------------- creation and lifetime
EXPORT Status cudarunner_delete_tensor_object(void *handle) {
  if (handle != nullptr) delete_tensor(as_tensor(handle));  // never fails: see cudarunner_delete_cuda_guard
  return kOk;
}

EXPORT Status cudarunner_empty_strided(int64_t dim, const int64_t *sizes, const int64_t *strides, int32_t dtype, int32_t device_type,
                                       int32_t device_index, void **result) {
  GUARD_NULL(result);
  Tensor *tensor = nullptr;
  if (new_empty(dim, sizes, strides, dtype, device_type, device_index, &tensor) != kOk) return kFailure;
  *result = tensor;
  return kOk;
}

// Refused on purpose: the AOTInductor runtime falls back to an ordinary copy.
EXPORT Status cudarunner_empty_strided_pinned(int64_t, const int64_t *, const int64_t *, int32_t, int32_t, int32_t, void **) {
  return fail("pinned host tensors are not provided by cuda-runner's shim");
}

EXPORT Status cudarunner_create_tensor_from_blob_v2(void *data, int64_t dim, const int64_t *sizes, const int64_t *strides, int64_t storage_offset,
                                                    int32_t dtype, int32_t device_type, int32_t device_index, void **result, int32_t layout,
                                                    const uint8_t *, int64_t) {
  GUARD_NULL(result);
  if (layout != 0) return fail("only strided tensors are supported (layout code %d)", layout);
  if (check_shape(dim, sizes, strides) != kOk) return kFailure;
  size_t size = element_size(dtype);
  if (size == 0) return fail("dtype code %d is not supported", dtype);
  if (!valid_device(device_type)) return fail("device type %d is not supported (CPU and CUDA only)", device_type);
  if (storage_offset < 0) return fail("a negative storage offset");
  int64_t span = 0, total = 0;
  size_t bytes = 0;
  if (!span_of(dim, sizes, strides, &span) || __builtin_add_overflow(span, storage_offset, &total) ||
      __builtin_mul_overflow(static_cast<size_t>(total), size, &bytes))
    return fail("a tensor's sizes and strides overflow or are negative");
  if (data == nullptr && span > 0) return fail("a tensor with elements but no data");
  Storage *storage = new_storage();
  if (storage == nullptr) return fail("out of host memory");
  storage->data = data;  // not owned: the caller keeps it alive
  storage->bytes = bytes;
  storage->device_type = device_type;
  storage->device_index = device_type == kDeviceCuda ? device_index : 0;
  Tensor *tensor = new_tensor(storage, storage_offset, dim, sizes, strides, dtype);
  if (tensor == nullptr) {
    release_storage(storage);
    return fail("out of host memory");
  }
  *result = tensor;
  return kOk;
}

EXPORT Status cudarunner_create_tensor_from_blob(void *data, int64_t dim, const int64_t *sizes, const int64_t *strides, int64_t storage_offset,
                                                 int32_t dtype, int32_t device_type, int32_t device_index, void **result) {
  return cudarunner_create_tensor_from_blob_v2(data, dim, sizes, strides, storage_offset, dtype, device_type, device_index, result, 0, nullptr, 0);
}

// A view: same storage, new sizes, strides and offset.
Status make_view(Tensor *source, int64_t dim, const int64_t *sizes, const int64_t *strides, int64_t offset, void **result,
                 bool within_storage = false) {
  if (check_shape(dim, sizes, strides) != kOk) return kFailure;
  if (offset < 0) return fail("a view with a negative storage offset");
  int64_t span = 0, end = 0;
  if (!span_of(dim, sizes, strides, &span) || __builtin_add_overflow(offset, span, &end))
    return fail("a view's sizes and strides overflow or are negative");
  // as_strided, like libtorch's, may not reach past the storage.
  if (within_storage && span > 0 &&
      (source->storage == nullptr || static_cast<uint64_t>(end) * element_size(source->dtype) > source->storage->bytes))
    return fail("a view reaches past the end of its storage");
  if (source->storage) source->storage->references.fetch_add(1, std::memory_order_relaxed);
  Tensor *view = new_tensor(source->storage, offset, dim, sizes, strides, source->dtype);
  if (view == nullptr) {
    release_storage(source->storage);
    return fail("out of host memory");
  }
  *result = view;
  return kOk;
}

EXPORT Status cudarunner__reinterpret_tensor(void *handle, int64_t dim, const int64_t *sizes, const int64_t *strides, int64_t offset_increment,
                                             void **result) {
  GUARD_NULL(handle);
  GUARD_NULL(result);
  Tensor *source = as_tensor(handle);
  int64_t offset;
  if (__builtin_add_overflow(source->offset, offset_increment, &offset)) return fail("_reinterpret_tensor: the offset overflows");
  // Unlike libtorch's, which trusts it: a view past its storage would let the
  // next clone or copy read or write past the allocation.
  return make_view(source, dim, sizes, strides, offset, result, true);
}

EXPORT Status cudarunner_as_strided(void *handle, const int64_t *sizes, const int64_t *strides, void **result) {
  GUARD_NULL(handle);
  GUARD_NULL(result);
  Tensor *source = as_tensor(handle);
  return make_view(source, source->dim, sizes, strides, source->offset, result, true);
}

EXPORT Status cudarunner_new_tensor_handle(void *handle, void **result) {
  GUARD_NULL(handle);
  GUARD_NULL(result);
  Tensor *source = as_tensor(handle);
  return make_view(source, source->dim, source->sizes, source->strides, source->offset, result);
}

EXPORT Status cudarunner_assign_tensors_out(void *source, void **result) { return cudarunner_new_tensor_handle(source, result); }

// libtorch's assign_tensors makes dst another name for src's data.
EXPORT Status cudarunner_assign_tensors(void *source_handle, void *destination_handle) {
  GUARD_NULL(source_handle);
  GUARD_NULL(destination_handle);
  Tensor *source = as_tensor(source_handle), *destination = as_tensor(destination_handle);
  if (source == destination) return kOk;
  Tensor *copy = new_tensor(source->storage, source->offset, source->dim, source->sizes, source->strides, source->dtype);
  if (copy == nullptr) return fail("out of host memory");
  if (source->storage) source->storage->references.fetch_add(1, std::memory_order_relaxed);
  release_storage(destination->storage);
  if (destination->sizes != destination->inline_dims) delete[] destination->sizes;
  destination->storage = copy->storage;
  destination->offset = copy->offset;
  destination->dim = copy->dim;
  destination->dtype = copy->dtype;
  if (copy->sizes == copy->inline_dims) {
    destination->sizes = destination->inline_dims;
    destination->strides = destination->inline_dims + kInlineDims;
    memcpy(destination->inline_dims, copy->inline_dims, sizeof copy->inline_dims);
  } else {
    destination->sizes = copy->sizes;
    destination->strides = copy->strides;
    copy->sizes = copy->inline_dims;  // moved
  }
  copy->storage = nullptr;
  delete_tensor(copy);
  return kOk;
}

EXPORT Status cudarunner_new_uninitialized_tensor(void **result) {
  GUARD_NULL(result);
  Tensor *tensor = new_tensor(nullptr, 0, 0, nullptr, nullptr, kFloat32);
  if (tensor == nullptr) return fail("out of host memory");
  *result = tensor;
  return kOk;
}

EXPORT Status cudarunner_clone(void *handle, void **result) {
  GUARD_NULL(handle);
  GUARD_NULL(result);
  Tensor *source = as_tensor(handle);
  if (require_data(source) != kOk) return kFailure;
  std::vector<int64_t> strides(source->dim);
  int64_t step = 1;
  for (int64_t d = source->dim - 1; d >= 0; --d) {
    strides[d] = step;
    step *= source->sizes[d] > 0 ? source->sizes[d] : 1;
  }
  Tensor *copy = nullptr;
  int32_t device = device_of(source);
  if (new_empty(source->dim, source->sizes, strides.data(), source->dtype, device, device == kDeviceCuda ? source->storage->device_index : 0,
                &copy) != kOk)
    return kFailure;
  if (copy_into(copy, source) != kOk) {
    delete_tensor(copy);
    return kFailure;
  }
  *result = copy;
  return kOk;
}

EXPORT Status cudarunner_clone_preserve_strides(void *handle, void **result) {
  GUARD_NULL(handle);
  GUARD_NULL(result);
  Tensor *source = as_tensor(handle);
  if (require_data(source) != kOk) return kFailure;
  Tensor *copy = nullptr;
  int32_t device = device_of(source);
  int32_t index = device == kDeviceCuda ? source->storage->device_index : 0;
  if (new_empty(source->dim, source->sizes, source->strides, source->dtype, device, index, &copy) != kOk) return kFailure;
  // The same strides over a buffer of the same span: one bulk copy of the span.
  if (copy_bytes(data_of(copy), device, data_of(source), device, span_bytes(source), index, false) != kOk) {
    delete_tensor(copy);
    return kFailure;
  }
  *result = copy;
  return kOk;
}

EXPORT Status cudarunner_copy_(void *self, void *source, int32_t) {
  GUARD_NULL(self);
  GUARD_NULL(source);
  return copy_into(as_tensor(self), as_tensor(source));
}

EXPORT Status cudarunner_tensor_copy_(void *source, void *destination) {
  GUARD_NULL(source);
  GUARD_NULL(destination);
  return copy_into(as_tensor(destination), as_tensor(source));
}

// A tensor over memory it does not own (a stack object: never counted, never freed).
struct BorrowedView {
  Storage storage;
  Tensor tensor;
  std::vector<int64_t> dims;

  BorrowedView(const Tensor *like, void *data, size_t bytes, int32_t device_type, int32_t device_index, std::vector<int64_t> sizes,
               std::vector<int64_t> strides)
      : dims(2 * sizes.size()) {
    storage.data = data;
    storage.bytes = bytes;
    storage.device_type = device_type;
    storage.device_index = device_index;
    storage.references = 2;  // never released through the tensor
    tensor.storage = &storage;
    tensor.dim = static_cast<int64_t>(sizes.size());
    tensor.dtype = like->dtype;
    tensor.sizes = dims.data();
    tensor.strides = dims.data() + sizes.size();
    std::copy(sizes.begin(), sizes.end(), tensor.sizes);
    std::copy(strides.begin(), strides.end(), tensor.strides);
  }
  ~BorrowedView() {
    tensor.storage = nullptr;
    tensor.sizes = tensor.inline_dims;  // the vector owns the dims
  }
};

EXPORT Status cudarunner_zero_(void *handle) {
  GUARD_NULL(handle);
  Tensor *tensor = as_tensor(handle);
  if (numel_of(tensor->dim, tensor->sizes) == 0) return kOk;
  if (require_data(tensor) != kOk) return kFailure;
  // Zeros written twice to one element are still zeros: dims of stride 0 (a
  // broadcast view, whose element count may exceed any memory) are written
  // once. What remains must address each element once.
  std::vector<int64_t> sizes, strides;
  for (int64_t d = 0; d < tensor->dim; ++d) {
    if (tensor->sizes[d] != 1 && tensor->strides[d] != 0) {
      sizes.push_back(tensor->sizes[d]);
      strides.push_back(tensor->strides[d]);
    }
  }
  if (!non_overlapping(static_cast<int64_t>(sizes.size()), sizes.data(), strides.data()))
    return fail("zero_: the tensor's elements overlap in memory in a way this shim does not write");
  size_t size = element_size(tensor->dtype);
  int32_t device = device_of(tensor), index = device == kDeviceCuda ? tensor->storage->device_index : 0;
  BorrowedView target(tensor, tensor->storage->data, tensor->storage->bytes, device, index, sizes, strides);
  target.tensor.offset = tensor->offset;
  int64_t count = numel_of(target.tensor.dim, target.tensor.sizes);  // at most the span: no element twice
  if (is_contiguous(&target.tensor)) {
    size_t bytes = static_cast<size_t>(count) * size;
    if (device == kDeviceCpu) {
      memset(data_of(tensor), 0, bytes);
      return kOk;
    }
    DeviceScope scope(index);
    if (scope.status() != kOk) return kFailure;
    CU(driver.cuMemsetD8Async(reinterpret_cast<CUdeviceptr>(data_of(tensor)), 0, bytes, stream_for(index)), "cuMemsetD8Async");
    return kOk;
  }
  // Strided: copied from a contiguous block of zeros.
  std::vector<int64_t> contiguous(sizes.size());
  int64_t step = 1;
  for (int64_t d = static_cast<int64_t>(sizes.size()) - 1; d >= 0; --d) {
    contiguous[d] = step;
    step *= sizes[d];
  }
  std::vector<char> zeros(static_cast<size_t>(count) * size, 0);
  BorrowedView source(tensor, zeros.data(), zeros.size(), kDeviceCpu, 0, sizes, contiguous);
  return copy_into(&target.tensor, &source.tensor);
}

#define ITEM(name, type, code) \
  EXPORT Status cudarunner_item_##name(void *handle, type *result) { return read_item<type>(handle, result, code); }
ITEM(float32, float, kFloat32)
ITEM(float64, double, kFloat64)
ITEM(uint8, uint8_t, kUInt8)
ITEM(uint16, uint16_t, kUInt16)
ITEM(uint32, uint32_t, kUInt32)
ITEM(uint64, uint64_t, kUInt64)
ITEM(int8, int8_t, kInt8)
ITEM(int16, int16_t, kInt16)
ITEM(int32, int32_t, kInt32)
ITEM(int64, int64_t, kInt64)
ITEM(bool, bool, kBool)
ITEM(float16, uint16_t, kFloat16)   // the bits, as libtorch's c10::Half holds them
ITEM(bfloat16, uint16_t, kBFloat16)

#define SCALAR(name, type, code)                                                               \
  EXPORT Status cudarunner_scalar_to_tensor_##name(type value, void **result) {                 \
    GUARD_NULL(result);                                                                        \
    Tensor *tensor = nullptr;                                                                  \
    if (new_empty(0, nullptr, nullptr, code, kDeviceCpu, 0, &tensor) != kOk) return kFailure;  \
    memcpy(data_of(tensor), &value, sizeof(type));                                             \
    *result = tensor;                                                                          \
    return kOk;                                                                                \
  }
SCALAR(float32, float, kFloat32)
SCALAR(float64, double, kFloat64)
SCALAR(uint8, uint8_t, kUInt8)
SCALAR(uint16, uint16_t, kUInt16)
SCALAR(uint32, uint32_t, kUInt32)
SCALAR(uint64, uint64_t, kUInt64)
SCALAR(int8, int8_t, kInt8)
SCALAR(int16, int16_t, kInt16)
SCALAR(int32, int32_t, kInt32)
SCALAR(int64, int64_t, kInt64)
SCALAR(bool, bool, kBool)

// ---------------------------------------------------------------- guards and streams
EXPORT Status cudarunner_create_cuda_guard(int32_t device_index, void **result) {
  GUARD_NULL(result);
  pthread_once(&driver_once, load_driver);
  CUcontext previous = current_context();
  if (use_device(device_index) != kOk) return kFailure;
  DeviceGuard *guard = new (std::nothrow) DeviceGuard{current_device, previous};
  if (guard == nullptr) return fail("out of host memory");
  current_device = device_index;
  *result = guard;
  return kOk;
}

EXPORT Status cudarunner_cuda_guard_set_index(void *handle, int32_t device_index) {
  GUARD_NULL(handle);
  if (use_device(device_index) != kOk) return kFailure;
  current_device = device_index;
  return kOk;
}

// Deleters never fail: generated code calls them from destructors, where a
// failure status terminates the process.
EXPORT Status cudarunner_delete_cuda_guard(void *handle) {
  if (handle == nullptr) return kOk;
  DeviceGuard *guard = static_cast<DeviceGuard *>(handle);
  current_device = guard->previous_device;
  restore_context(guard->previous_context);
  delete guard;
  return kOk;
}

// A null stream is accepted: it is the legacy default stream.
EXPORT Status cudarunner_create_cuda_stream_guard(void *stream, int32_t device_index, void **result) {
  GUARD_NULL(result);
  if (device_index < 0 || device_index >= kMaxDevices) return fail("CUDA device index %d is out of range", device_index);
  pthread_once(&driver_once, load_driver);
  CUcontext previous = current_context();
  if (use_device(device_index) != kOk) return kFailure;
  StreamGuard *guard = new (std::nothrow) StreamGuard{device_index, current_stream[device_index], current_device, previous};
  if (guard == nullptr) return fail("out of host memory");
  current_stream[device_index] = static_cast<CUstream>(stream);
  current_device = device_index;
  *result = guard;
  return kOk;
}

EXPORT Status cudarunner_delete_cuda_stream_guard(void *handle) {
  if (handle == nullptr) return kOk;
  StreamGuard *guard = static_cast<StreamGuard *>(handle);
  current_stream[guard->device] = guard->previous_stream;
  current_device = guard->previous_device;
  restore_context(guard->previous_context);
  delete guard;
  return kOk;
}

EXPORT Status cudarunner_get_current_cuda_stream(int32_t device_index, void **result) {
  GUARD_NULL(result);
  if (device_index < 0) device_index = current_device;
  if (device_index >= kMaxDevices) return fail("CUDA device index %d is out of range", device_index);
  *result = current_stream[device_index];
  return kOk;
}

EXPORT Status cudarunner_get_current_device_index(int32_t *result) {
  GUARD_NULL(result);
  *result = current_device;
  return kOk;
}

// ---------------------------------------------------------------- CPU extern kernels
EXPORT Status cudarunner_cpu_addmm_out(void *out, void *self, void *a, void *b, double beta, double alpha) {
  GUARD_NULL(out);
  GUARD_NULL(a);
  GUARD_NULL(b);
  return cpu_addmm(as_tensor(out), as_tensor(self), as_tensor(a), as_tensor(b), beta, alpha);
}

EXPORT Status cudarunner_cpu_mm_out(void *out, void *a, void *b) {
  GUARD_NULL(out);
  GUARD_NULL(a);
  GUARD_NULL(b);
  return cpu_addmm(as_tensor(out), nullptr, as_tensor(a), as_tensor(b), 0.0, 1.0);
}

EXPORT Status cudarunner_cpu_bmm_out(void *out, void *a, void *b) {
  GUARD_NULL(out);
  GUARD_NULL(a);
  GUARD_NULL(b);
  Tensor *o = as_tensor(out), *x = as_tensor(a), *y = as_tensor(b);
  if (o->dim != 3 || x->dim != 3 || y->dim != 3 || x->sizes[0] != y->sizes[0] || o->sizes[0] != x->sizes[0]) return fail("bmm needs 3-D batches of one size");
  for (Tensor *batch : {o, x, y}) if (require_data(batch) != kOk) return kFailure;
  if (!non_overlapping(o)) return fail("bmm: more than one element of out refers to a single memory location");
  if (ranges_meet(o, x) || ranges_meet(o, y)) return fail("bmm: out overlaps an input in memory");
  for (int64_t batch = 0; batch < x->sizes[0]; ++batch) {
    Tensor o2, x2, y2;
    for (auto [target, source] : {std::pair<Tensor *, Tensor *>{&o2, o}, {&x2, x}, {&y2, y}}) {
      target->storage = source->storage;
      target->offset = source->offset + batch * source->strides[0];
      target->dim = 2;
      target->dtype = source->dtype;
      target->sizes[0] = source->sizes[1];
      target->sizes[1] = source->sizes[2];
      target->strides[0] = source->strides[1];
      target->strides[1] = source->strides[2];
    }
    Status status = cpu_addmm(&o2, nullptr, &x2, &y2, 0.0, 1.0);
    o2.storage = x2.storage = y2.storage = nullptr;
    if (status != kOk) return status;
  }
  return kOk;
}

// One of a convolution's int lists (stride, padding, dilation, output_padding):
// `spatial` values, or one given for every spatial dim, as libtorch expands it.
bool conv_parameter(const int64_t *values, int64_t length, int spatial, int64_t fallback, int64_t *expanded) {
  if (length == 0 || values == nullptr) {
    std::fill_n(expanded, spatial, fallback);
    return true;
  }
  if (length != 1 && length != spatial) return false;
  for (int d = 0; d < spatial; ++d) expanded[d] = values[length == 1 ? 0 : d];
  return true;
}

// libtorch's aten::convolution for CPU tensors: 1 to 3 spatial dims (an
// unbatched input too), groups, dilation, transposed. The result is a new
// tensor, channels-last when the input or weight is (as libtorch decides).
EXPORT Status cudarunner_cpu_convolution(void *input_handle, void *weight_handle, void **bias_handle, const int64_t *stride, int64_t stride_len,
                                         const int64_t *padding, int64_t padding_len, const int64_t *dilation, int64_t dilation_len,
                                         int32_t transposed, const int64_t *output_padding, int64_t output_padding_len, int64_t groups,
                                         void **result) {
  GUARD_NULL(input_handle);
  GUARD_NULL(weight_handle);
  GUARD_NULL(result);
  Tensor *input = as_tensor(input_handle), *weight = as_tensor(weight_handle);
  Tensor *bias = bias_handle != nullptr ? as_tensor(*bias_handle) : nullptr;
  int spatial = static_cast<int>(weight->dim) - 2;
  if (spatial < 1 || spatial > 3) return fail("convolution: a weight of %lld dims (1 to 3 spatial dims are supported)", static_cast<long long>(weight->dim));
  bool batched = input->dim == weight->dim;
  if (!batched && input->dim != weight->dim - 1) return fail("convolution: an input of %lld dims for a weight of %lld", (long long)input->dim, (long long)weight->dim);
  for (const Tensor *tensor : {input, weight, bias}) {
    if (tensor == nullptr) continue;
    if (require_data(tensor) != kOk) return kFailure;
    if (device_of(tensor) != kDeviceCpu) return fail("cpu convolution got a CUDA tensor");
    if (tensor->dtype != input->dtype) return fail("convolution: mixed dtypes");
  }
  cr::Element element;
  if (!gemm_element(input->dtype, &element)) return fail("cpu convolution computes float32, float64, float16 and bfloat16, not dtype code %d", input->dtype);
  cr::ConvShape shape{};
  shape.spatial = spatial;
  shape.transposed = transposed != 0;
  shape.groups = groups;
  int first = batched ? 2 : 1;
  shape.batch = batched ? input->sizes[0] : 1;
  shape.in_channels = input->sizes[first - 1];
  if (groups < 1 || shape.in_channels % groups != 0) return fail("convolution: %lld input channels in %lld groups", (long long)shape.in_channels, (long long)groups);
  shape.out_channels = shape.transposed ? weight->sizes[1] * groups : weight->sizes[0];
  int64_t weight_in = shape.transposed ? weight->sizes[0] : weight->sizes[1] * groups;
  if (weight_in != shape.in_channels || (!shape.transposed && shape.out_channels % groups != 0))
    return fail("convolution: the weight's channels do not match the input's %lld channels in %lld groups", (long long)shape.in_channels, (long long)groups);
  int64_t extra[3];
  if (!conv_parameter(stride, stride_len, spatial, 1, shape.stride) || !conv_parameter(padding, padding_len, spatial, 0, shape.padding) ||
      !conv_parameter(dilation, dilation_len, spatial, 1, shape.dilation) ||
      !conv_parameter(output_padding, output_padding_len, spatial, 0, extra))
    return fail("convolution: a stride, padding, dilation or output padding list of the wrong length");
  for (int d = 0; d < spatial; ++d) {
    shape.in_size[d] = input->sizes[first + d];
    shape.kernel[d] = weight->sizes[2 + d];
    if (shape.stride[d] < 1 || shape.dilation[d] < 1 || shape.padding[d] < 0 || extra[d] < 0 || (shape.transposed && extra[d] >= std::max(shape.stride[d], shape.dilation[d])))
      return fail("convolution: a stride, dilation, padding or output padding out of range");
    int64_t reach = shape.dilation[d] * (shape.kernel[d] - 1) + 1;
    shape.out_size[d] = shape.transposed ? (shape.in_size[d] - 1) * shape.stride[d] - 2 * shape.padding[d] + reach + extra[d]
                                         : (shape.in_size[d] + 2 * shape.padding[d] - reach) / shape.stride[d] + 1;
    if (shape.out_size[d] < 1 || (!shape.transposed && shape.in_size[d] + 2 * shape.padding[d] < reach))
      return fail("convolution: the kernel is larger than the padded input");
  }
  if (bias != nullptr && (bias->dim != 1 || bias->sizes[0] != shape.out_channels)) return fail("convolution: the bias does not have one value per output channel");
  // The result's layout: channels last where the input or the weight is (libtorch's rule), else contiguous.
  auto channels_last = [&](const Tensor *tensor) {
    return tensor->dim == 4 && tensor->strides[1] == 1 && tensor->sizes[1] > 1 && !is_contiguous(tensor);
  };
  int64_t out_dims = batched ? 2 + spatial : 1 + spatial;
  int64_t sizes[5], strides[5];
  int64_t all_sizes[5] = {shape.batch, shape.out_channels, shape.out_size[0], shape.out_size[1], shape.out_size[2]};
  for (int64_t d = 0; d < out_dims; ++d) sizes[d] = all_sizes[batched ? d : d + 1];
  bool last = batched && spatial == 2 && (channels_last(input) || channels_last(weight));
  int64_t step = 1;
  if (last) {  // N, C, H, W with C innermost
    strides[1] = 1;
    strides[3] = shape.out_channels;
    strides[2] = shape.out_channels * sizes[3];
    strides[0] = strides[2] * sizes[2];
  } else {
    for (int64_t d = out_dims - 1; d >= 0; --d) {
      strides[d] = step;
      step *= sizes[d];
    }
  }
  Tensor *output = nullptr;
  if (new_empty(out_dims, sizes, strides, input->dtype, kDeviceCpu, 0, &output) != kOk) return kFailure;
  auto described = [&](const Tensor *tensor, bool has_batch) {
    cr::Strided view{data_of(tensor), {0, 0, 0, 0, 0}};
    int offset = has_batch ? 0 : 1;  // an unbatched tensor: batch stride 0 (one element)
    for (int64_t d = 0; d < tensor->dim; ++d) view.strides[d + offset] = tensor->strides[d];
    return view;
  };
  std::string error;
  bool done = cr::convolution(element, shape, described(output, batched), described(input, batched), described(weight, true),
                              bias != nullptr ? data_of(bias) : nullptr, bias != nullptr ? bias->strides[0] : 0, &error);
  if (!done) {
    delete_tensor(output);
    return fail("convolution: %s", error.c_str());
  }
  *result = output;
  return kOk;
}

// The BLAS the CPU GEMMs and convolutions use (cpu_kernels.cpp): the runtime
// gives the path of a scipy-openblas build it found; "" while there is none.
EXPORT Status cudarunner_shim_use_blas(const char *path) {
  GUARD_NULL(path);
  std::string error;
  if (!cr::load_blas(path, &error)) return fail("%s", error.c_str());
  return kOk;
}
EXPORT const char *cudarunner_shim_blas() { return cr::blas_path(); }
