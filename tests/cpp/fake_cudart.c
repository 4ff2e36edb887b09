/* A fake CUDA runtime: the libcudart calls PyTorch makes to start CUDA
 * (torch.cuda.init), make and free tensors that no kernel touches
 * (torch.empty), and ask for memory figures, answered without a GPU.
 * Preloaded into a test process over torch's own libcudart, so that
 * PyTorch's real allocation path, its real exception translation and its
 * real memory functions run down to Waterwave over the fake driver
 * (fake_cuda.c), which the test names libcuda.so.1 on LD_LIBRARY_PATH.
 *
 * No kernel runs: a call that would need one (a copy, a fill) is not here
 * and fails in the real runtime as it would without a driver. Streams and
 * events are counters. Streams capture into CUDA graphs (the fake driver
 * keeps the captures and their rules); a graph replays nothing. PyTorch resolves its
 * driver API through cudaGetDriverEntryPointByVersion: the fake driver's
 * entry point when it has one, else a stub answering "not supported". */
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { SUCCESS = 0, INVALID_VALUE = 1, INVALID_DEVICE = 101, NOT_SUPPORTED = 801,
       ILLEGAL_STATE = 401, CAPTURE_INVALIDATED = 901 };

static int device_count(void) {
  const char* n = getenv("FAKE_CUDA_DEVICES");
  return n ? atoi(n) : 1;
}

static __thread int current_device;

int cudaGetDeviceCount(int* count) {
  *count = device_count();
  return SUCCESS;
}

int cudaGetDevice(int* device) {
  *device = current_device;
  return SUCCESS;
}

int cudaSetDevice(int device) {
  if (device < 0 || device >= device_count()) return INVALID_DEVICE;
  current_device = device;
  return SUCCESS;
}

int cudaDriverGetVersion(int* version) {
  *version = 13000;
  return SUCCESS;
}

int cudaRuntimeGetVersion(int* version) {
  *version = 13000;
  return SUCCESS;
}

int cudaGetLastError(void) { return SUCCESS; }
int cudaPeekAtLastError(void) { return SUCCESS; }
const char* cudaGetErrorString(int error) { return error ? "fake CUDA runtime error" : "no error"; }
const char* cudaGetErrorName(int error) { return error ? "cudaErrorFake" : "cudaSuccess"; }

/* ---- the driver, for PyTorch's DriverAPI and memory figures ------------- */
static void* driver(void) {
  static void* handle;
  if (!handle) handle = dlopen("libcuda.so.1", RTLD_NOW);
  return handle;
}

static int not_supported(void) { return NOT_SUPPORTED; }

int cudaGetDriverEntryPointByVersion(const char* symbol, void** fn, unsigned long long flags,
                                     unsigned int version, int* status) {
  (void)flags, (void)version;
  void* found = driver() ? dlsym(driver(), symbol) : NULL;
  if (!found && strstr(symbol, "_v2") == NULL) {  /* cuMemGetInfo -> cuMemGetInfo_v2 */
    char v2[128];
    if (strlen(symbol) + 4 < sizeof v2) {
      strcpy(v2, symbol);
      strcat(v2, "_v2");
      found = driver() ? dlsym(driver(), v2) : NULL;
    }
  }
  *fn = found ? found : (void*)&not_supported;
  if (status) *status = 0; /* cudaDriverEntryPointSuccess */
  return SUCCESS;
}

int cudaGetDriverEntryPoint(const char* symbol, void** fn, unsigned long long flags, int* status) {
  return cudaGetDriverEntryPointByVersion(symbol, fn, flags, 13000, status);
}

int cudaMemGetInfo(size_t* free_bytes, size_t* total) {
  typedef int (*MemGetInfo)(size_t*, size_t*);
  MemGetInfo get = driver() ? (MemGetInfo)dlsym(driver(), "cuMemGetInfo_v2") : NULL;
  if (!get || get(free_bytes, total) != 0) return NOT_SUPPORTED;
  return SUCCESS;
}

/* ---- streams and events: handles and counters -------------------------- */
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static uintptr_t next_handle = 0x10000;

static void* new_handle(void) {
  pthread_mutex_lock(&mu);
  uintptr_t h = next_handle;
  next_handle += 0x100;
  pthread_mutex_unlock(&mu);
  return (void*)h;
}

int cudaDeviceGetStreamPriorityRange(int* least, int* greatest) {
  if (least) *least = 0;
  if (greatest) *greatest = -5;
  return SUCCESS;
}
int cudaStreamCreateWithPriority(void** stream, unsigned flags, int priority) {
  (void)flags, (void)priority;
  *stream = new_handle();
  return SUCCESS;
}
int cudaStreamCreateWithFlags(void** stream, unsigned flags) {
  return cudaStreamCreateWithPriority(stream, flags, 0);
}
int cudaStreamDestroy(void* stream) { (void)stream; return SUCCESS; }
int cudaStreamSynchronize(void* stream) { (void)stream; return SUCCESS; }
int cudaStreamQuery(void* stream) { (void)stream; return SUCCESS; }
int cudaStreamWaitEvent(void* stream, void* event, unsigned flags) {
  (void)stream, (void)event, (void)flags;
  return SUCCESS;
}
/* Stream capture: the fake driver keeps it (fake_cuda.c), so that the
 * allocator's driver calls see the same captures PyTorch's runtime calls do. */
static void* driver_fn(const char* name) { return driver() ? dlsym(driver(), name) : NULL; }
typedef int (*capture_status_fn)(void*, unsigned long long*);
static int capture_status(void* stream, unsigned long long* id) {
  capture_status_fn fn = (capture_status_fn)driver_fn("fake_cuda_capture_status");
  if (!fn) {
    if (id) *id = 0;
    return 0;
  }
  return fn(stream, id);
}
int cudaStreamIsCapturing(void* stream, int* status) {
  *status = capture_status(stream, NULL);
  return SUCCESS;
}
int cudaThreadExchangeStreamCaptureMode(int* mode) {
  typedef int (*exchange_fn)(int*);
  exchange_fn fn = (exchange_fn)driver_fn("cuThreadExchangeStreamCaptureMode");
  return fn ? fn(mode) : SUCCESS;
}
int cudaStreamBeginCapture(void* stream, int mode) {
  typedef unsigned long long (*begin_fn)(void*, int);
  begin_fn fn = (begin_fn)driver_fn("fake_cuda_begin_capture");
  return fn && fn(stream, mode) ? SUCCESS : ILLEGAL_STATE;
}
int cudaStreamEndCapture(void* stream, void** graph) {
  typedef int (*end_fn)(void*);
  end_fn fn = (end_fn)driver_fn("fake_cuda_end_capture");
  int r = fn ? fn(stream) : INVALID_VALUE;
  *graph = r == SUCCESS ? new_handle() : NULL;
  return r == SUCCESS ? SUCCESS : r == INVALID_VALUE ? ILLEGAL_STATE : CAPTURE_INVALIDATED;
}
/* Graphs: handles; nothing runs on replay (no kernel ever does here). */
int cudaGraphGetNodes(void* graph, void** nodes, size_t* count) {
  (void)graph;
  if (!nodes) *count = 1;
  return SUCCESS;
}
int cudaGraphInstantiateWithFlags(void** exec, void* graph, unsigned long long flags) {
  (void)graph, (void)flags;
  *exec = new_handle();
  return SUCCESS;
}
int cudaGraphInstantiate(void** exec, void* graph, unsigned long long flags) {
  return cudaGraphInstantiateWithFlags(exec, graph, flags);
}
int cudaGraphLaunch(void* exec, void* stream) { (void)exec, (void)stream; return SUCCESS; }
int cudaGraphDestroy(void* graph) { (void)graph; return SUCCESS; }
int cudaGraphExecDestroy(void* exec) { (void)exec; return SUCCESS; }
int cudaDeviceSynchronize(void) { return SUCCESS; }
int cudaEventCreateWithFlags(void** event, unsigned flags) {
  (void)flags;
  *event = new_handle();
  return SUCCESS;
}
int cudaEventCreate(void** event) { return cudaEventCreateWithFlags(event, 0); }
int cudaEventDestroy(void* event) { (void)event; return SUCCESS; }
int cudaEventRecord(void* event, void* stream) { (void)event, (void)stream; return SUCCESS; }
int cudaEventRecordWithFlags(void* event, void* stream, unsigned flags) {
  (void)event, (void)stream, (void)flags;
  return SUCCESS;
}
int cudaEventQuery(void* event) { (void)event; return SUCCESS; }
int cudaEventSynchronize(void* event) { (void)event; return SUCCESS; }
int cudaDeviceCanAccessPeer(int* can, int device, int peer) {
  (void)device, (void)peer;
  *can = 0;
  return SUCCESS;
}
/* CUDA 13's signature; the trailing outputs may be NULL. */
int cudaStreamGetCaptureInfo(void* stream, int* status, unsigned long long* id, void** graph,
                             const void** deps, const void** edges, size_t* num_deps) {
  *status = capture_status(stream, id);
  if (graph) *graph = NULL;
  if (deps) *deps = NULL;
  if (edges) *edges = NULL;
  if (num_deps) *num_deps = 0;
  return SUCCESS;
}

#ifdef FAKE_CUDART_WITH_HEADERS
/* The properties struct's layout is the CUDA headers' (driver_types.h
 * declares types only, none of the functions defined here). A device as
 * PyTorch checks one: compute capability 9.0, the fake driver's memory. */
#include <driver_types.h>
int cudaGetDeviceProperties(struct cudaDeviceProp* prop, int device) {
  if (device < 0 || device >= device_count()) return INVALID_DEVICE;
  memset(prop, 0, sizeof *prop);
  strcpy(prop->name, "Waterwave fake GPU");
  size_t free_bytes = 0, total = 0;
  if (cudaMemGetInfo(&free_bytes, &total) == SUCCESS) prop->totalGlobalMem = total;
  prop->major = 9;
  prop->minor = 0;
  prop->multiProcessorCount = 132;
  prop->warpSize = 32;
  prop->maxThreadsPerBlock = 1024;
  prop->maxThreadsPerMultiProcessor = 2048;
  prop->l2CacheSize = 50 << 20;
  return SUCCESS;
}
#endif
