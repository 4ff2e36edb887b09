/* A fake CUDA driver (libcuda.so's entry points the Waterwave backend uses),
 * so the backend's real code runs on a machine without a GPU.
 *
 * Memory is real host memory, so tests can write through the pointers the
 * allocator hands out and catch corruption. It is carved from one reserved
 * address range, lowest free address first, as a GPU's fresh context and the
 * simulated device hand it out: caching policies break ties by address, so
 * a run here and its replay on the simulator choose alike. Like the real driver, memory
 * calls need a current context, and events complete only when the test says
 * so (fake_cuda_complete_all), a synchronize waits for them, or the GPU is
 * idle (fake_cuda_set_idle): that is what
 * lets tests drive the allocator's cross-stream paths. Counters say which
 * calls were made. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
enum {
  SUCCESS = 0, INVALID_VALUE = 1, OUT_OF_MEMORY = 2, NOT_INITIALIZED = 3,
  INVALID_CONTEXT = 201, INVALID_HANDLE = 400, NOT_READY = 600
};

#define MAX_DEVICES 4
#define MAX_ALLOCS 8192
#define MAX_EVENTS 4096

struct ctx { int device; };
struct event { int pending, captured; };
struct alloc { void* ptr; size_t size; };

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static int initialized, device_count = 1;
static size_t capacity = (size_t)1 << 30, in_use;
static struct ctx contexts[MAX_DEVICES];
static __thread struct ctx* current;
static struct alloc allocs[MAX_ALLOCS];
/* Address space for every allocation: reserved, not committed, so only the
 * pages tests touch cost host memory; freed pages are given back. */
#define ARENA_BYTES ((size_t)1 << 36)
static char* arena;
static int fail_next_alloc;
static int idle; /* an idle GPU: recorded events complete at once */
static struct event* events[MAX_EVENTS];
static long long n_alloc, n_free, n_event_create, n_event_destroy, n_record, n_query,
    n_event_sync, n_wait, n_ctx_sync, n_ctx_set;

/* ---- stream capture (CUDA graphs) ---------------------------------------
 * A stream captures between fake_cuda_begin_capture and fake_cuda_end_capture
 * (the fake runtime's cudaStreamBeginCapture and cudaStreamEndCapture). As
 * with the real driver: an event recorded on a capturing stream belongs to
 * the capture, so querying, synchronizing or waiting on it from outside
 * fails; nothing may synchronize the device while a stream captures; and
 * while a capture in global or thread-local mode is under way, a thread
 * whose capture mode is not relaxed may not make unsafe calls (allocate or
 * free memory, query or synchronize events). A call refused so invalidates
 * every capture, whose end then fails, and counts as a violation. */
#define MAX_CAPTURES 16
enum { CAPTURE_UNSUPPORTED = 900, CAPTURE_INVALIDATED = 901, CAPTURE_IMPLICIT = 906,
       CAPTURED_EVENT = 907 };
enum { MODE_GLOBAL = 0, MODE_THREAD_LOCAL = 1, MODE_RELAXED = 2 };
struct capture { void* stream; unsigned long long id; int mode, invalidated; };
static struct capture captures[MAX_CAPTURES];
static unsigned long long next_capture_id = 1;
static __thread int thread_mode = MODE_GLOBAL;
static long long n_capture_violations;

static struct capture* capture_of_locked(void* stream) {
  for (int i = 0; i < MAX_CAPTURES; ++i)
    if (captures[i].id && captures[i].stream == stream) return &captures[i];
  return NULL;
}
static int capturing_locked(void) {
  for (int i = 0; i < MAX_CAPTURES; ++i)
    if (captures[i].id) return 1;
  return 0;
}
static int unsafe_refused_locked(void) {
  if (thread_mode == MODE_RELAXED) return 0;
  for (int i = 0; i < MAX_CAPTURES; ++i)
    if (captures[i].id && captures[i].mode != MODE_RELAXED) return 1;
  return 0;
}
static CUresult violation_locked(CUresult code) {
  ++n_capture_violations;
  for (int i = 0; i < MAX_CAPTURES; ++i)
    if (captures[i].id) captures[i].invalidated = 1;
  return code;
}

/* The capture's id; 0 if the stream captures already or too many do. */
unsigned long long fake_cuda_begin_capture(void* stream, int mode) {
  pthread_mutex_lock(&mu);
  unsigned long long id = 0;
  if (!capture_of_locked(stream)) {
    for (int i = 0; i < MAX_CAPTURES && !id; ++i) {
      if (!captures[i].id) {
        captures[i] = (struct capture){stream, next_capture_id++, mode, 0};
        id = captures[i].id;
      }
    }
  }
  pthread_mutex_unlock(&mu);
  return id;
}
/* 0: not capturing; 1: capturing; 2: capturing, invalidated. */
int fake_cuda_capture_status(void* stream, unsigned long long* id) {
  pthread_mutex_lock(&mu);
  struct capture* c = capture_of_locked(stream);
  int status = !c ? 0 : c->invalidated ? 2 : 1;
  if (id) *id = c ? c->id : 0;
  pthread_mutex_unlock(&mu);
  return status;
}
/* 0, or CAPTURE_INVALIDATED, or INVALID_VALUE for a stream not capturing. */
int fake_cuda_end_capture(void* stream) {
  pthread_mutex_lock(&mu);
  struct capture* c = capture_of_locked(stream);
  int r = !c ? INVALID_VALUE : c->invalidated ? CAPTURE_INVALIDATED : SUCCESS;
  if (c) memset(c, 0, sizeof *c);
  pthread_mutex_unlock(&mu);
  return r;
}
long long fake_cuda_capture_violations(void) { return n_capture_violations; }

CUresult cuStreamIsCapturing(void* stream, int* status) {
  *status = fake_cuda_capture_status(stream, NULL);
  return SUCCESS;
}
CUresult cuThreadExchangeStreamCaptureMode(int* mode) {
  int old = thread_mode;
  thread_mode = *mode;
  *mode = old;
  return SUCCESS;
}

/* ---- test controls ---------------------------------------------------- */
long long fake_cuda_vmm_counter(const char* name); /* below, with the VMM calls */
void fake_cuda_reset_vmm_counters(void);
void fake_cuda_set_capacity(size_t bytes) { capacity = bytes; }
void fake_cuda_set_device_count(int n) { device_count = n < MAX_DEVICES ? n : MAX_DEVICES; }
void fake_cuda_fail_next_alloc(int code) { fail_next_alloc = code; }
void fake_cuda_set_idle(int on) { idle = on; }

static void complete_all_locked(void) {
  for (int i = 0; i < MAX_EVENTS; ++i)
    if (events[i]) events[i]->pending = 0;
}
void fake_cuda_complete_all(void) {
  pthread_mutex_lock(&mu);
  complete_all_locked();
  pthread_mutex_unlock(&mu);
}
void fake_cuda_reset_counters(void) {
  n_alloc = n_free = n_event_create = n_event_destroy = n_record = n_query = n_event_sync =
      n_wait = n_ctx_sync = n_ctx_set = 0;
  fake_cuda_reset_vmm_counters();
}
long long fake_cuda_counter(const char* name) {
  if (!strcmp(name, "alloc")) return n_alloc;
  if (!strcmp(name, "free")) return n_free;
  if (!strcmp(name, "event_create")) return n_event_create;
  if (!strcmp(name, "event_destroy")) return n_event_destroy;
  if (!strcmp(name, "event_record")) return n_record;
  if (!strcmp(name, "event_query")) return n_query;
  if (!strcmp(name, "event_sync")) return n_event_sync;
  if (!strcmp(name, "stream_wait")) return n_wait;
  if (!strcmp(name, "ctx_sync")) return n_ctx_sync;
  if (!strcmp(name, "ctx_set")) return n_ctx_set;
  if (!strcmp(name, "bytes_in_use")) return (long long)in_use;
  if (!strncmp(name, "vmm_", 4)) return fake_cuda_vmm_counter(name + 4);
  return -1;
}
/* The calling thread's current context's device, or -1 for none. */
int fake_cuda_current_device(void) { return current ? current->device : -1; }

/* ---- the driver API ------------------------------------------------------ */
CUresult cuInit(unsigned flags) {
  (void)flags;
  initialized = 1;
  for (int i = 0; i < MAX_DEVICES; ++i) contexts[i].device = i;
  return SUCCESS;
}
CUresult cuDeviceGetCount(int* n) {
  if (!initialized) return NOT_INITIALIZED;
  *n = device_count;
  return SUCCESS;
}
CUresult cuDeviceGet(int* dev, int ordinal) {
  if (ordinal < 0 || ordinal >= device_count) return INVALID_VALUE;
  *dev = ordinal;
  return SUCCESS;
}
CUresult cuDeviceTotalMem_v2(size_t* bytes, int dev) {
  (void)dev;
  *bytes = capacity;
  return SUCCESS;
}
CUresult cuDevicePrimaryCtxRetain(struct ctx** out, int dev) {
  if (dev < 0 || dev >= device_count) return INVALID_VALUE;
  *out = &contexts[dev];
  return SUCCESS;
}
CUresult cuCtxGetCurrent(struct ctx** out) {
  *out = current;
  return SUCCESS;
}
CUresult cuCtxSetCurrent(struct ctx* c) {
  current = c;
  __atomic_add_fetch(&n_ctx_set, 1, __ATOMIC_RELAXED);
  return SUCCESS;
}
CUresult cuCtxSynchronize(void) {
  if (!current) return INVALID_CONTEXT;
  pthread_mutex_lock(&mu);
  if (capturing_locked()) {
    CUresult r = violation_locked(CAPTURE_UNSUPPORTED);
    pthread_mutex_unlock(&mu);
    return r;
  }
  ++n_ctx_sync;
  complete_all_locked();
  pthread_mutex_unlock(&mu);
  return SUCCESS;
}
static size_t round_up(size_t bytes) { return (bytes + 511) / 512 * 512; }

/* The lowest free range of the arena that holds `bytes` (512-byte aligned,
 * like cudaMalloc's): the start of the arena or the end of a live block. */
static void* carve_locked(size_t bytes) {
  if (!arena) {
    void* a = mmap(NULL, ARENA_BYTES, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (a == MAP_FAILED) return NULL;
    arena = a;
  }
  const size_t need = round_up(bytes);
  char* best = NULL;
  for (int c = -1; c < MAX_ALLOCS; ++c) {
    char* start = c < 0 ? arena : allocs[c].ptr ? (char*)allocs[c].ptr + round_up(allocs[c].size) : NULL;
    if (!start || start + need > arena + ARENA_BYTES || (best && start >= best)) continue;
    int clear = 1;
    for (int i = 0; i < MAX_ALLOCS && clear; ++i) {
      char* p = allocs[i].ptr;
      if (p && p < start + need && start < p + round_up(allocs[i].size)) clear = 0;
    }
    if (clear) best = start;
  }
  return best;
}

CUresult cuMemAlloc_v2(CUdeviceptr* out, size_t bytes) {
  if (!current) return INVALID_CONTEXT;
  if (bytes == 0) return INVALID_VALUE;
  pthread_mutex_lock(&mu);
  CUresult r = SUCCESS;
  if (unsafe_refused_locked()) {
    r = violation_locked(CAPTURE_IMPLICIT);
  } else if (fail_next_alloc) {
    r = fail_next_alloc;
    fail_next_alloc = 0;
  } else if (bytes > capacity - in_use) {
    r = OUT_OF_MEMORY;
  } else {
    int slot = -1;
    for (int i = 0; i < MAX_ALLOCS && slot < 0; ++i)
      if (!allocs[i].ptr) slot = i;
    void* p = slot < 0 ? NULL : carve_locked(bytes);
    if (!p) {
      r = OUT_OF_MEMORY;
    } else {
      allocs[slot].ptr = p;
      allocs[slot].size = bytes;
      in_use += bytes;
      ++n_alloc;
      *out = (CUdeviceptr)(size_t)p;
    }
  }
  pthread_mutex_unlock(&mu);
  return r;
}
CUresult cuMemFree_v2(CUdeviceptr ptr) {
  if (!current) return INVALID_CONTEXT;
  pthread_mutex_lock(&mu);
  CUresult r = INVALID_VALUE;
  if (unsafe_refused_locked()) {
    r = violation_locked(CAPTURE_IMPLICIT);
    pthread_mutex_unlock(&mu);
    return r;
  }
  for (int i = 0; i < MAX_ALLOCS; ++i) {
    if (allocs[i].ptr && (CUdeviceptr)(size_t)allocs[i].ptr == ptr) {
      complete_all_locked(); /* cudaFree synchronizes the device */
      madvise(allocs[i].ptr, round_up(allocs[i].size), MADV_DONTNEED);
      in_use -= allocs[i].size;
      allocs[i].ptr = NULL;
      ++n_free;
      r = SUCCESS;
      break;
    }
  }
  pthread_mutex_unlock(&mu);
  return r;
}
CUresult cuMemGetInfo_v2(size_t* free_bytes, size_t* total) {
  if (!current) return INVALID_CONTEXT;
  pthread_mutex_lock(&mu);  /* in_use moves under it (ThreadSanitizer saw the race) */
  *free_bytes = capacity > in_use ? capacity - in_use : 0;
  *total = capacity;
  pthread_mutex_unlock(&mu);
  return SUCCESS;
}

static int event_slot(struct event* e) {
  for (int i = 0; i < MAX_EVENTS; ++i)
    if (events[i] == e) return i;
  return -1;
}
CUresult cuEventCreate(struct event** out, unsigned flags) {
  (void)flags;
  if (!current) return INVALID_CONTEXT;
  pthread_mutex_lock(&mu);
  int slot = event_slot(NULL);
  CUresult r = OUT_OF_MEMORY;
  if (slot >= 0) {
    events[slot] = calloc(1, sizeof(struct event));
    *out = events[slot];
    ++n_event_create;
    r = SUCCESS;
  }
  pthread_mutex_unlock(&mu);
  return r;
}
CUresult cuEventDestroy_v2(struct event* e) {
  pthread_mutex_lock(&mu);
  int slot = e ? event_slot(e) : -1;
  if (slot >= 0) {
    free(e);
    events[slot] = NULL;
    ++n_event_destroy;
  }
  pthread_mutex_unlock(&mu);
  return slot >= 0 ? SUCCESS : INVALID_HANDLE;
}
CUresult cuEventRecord(struct event* e, void* stream) {
  if (!current) return INVALID_CONTEXT;
  pthread_mutex_lock(&mu);
  int ok = e && event_slot(e) >= 0;
  if (ok) {
    e->pending = !idle; /* work queued before it has not run yet */
    e->captured = capture_of_locked(stream) != NULL;
    ++n_record;
  }
  pthread_mutex_unlock(&mu);
  return ok ? SUCCESS : INVALID_HANDLE;
}
CUresult cuEventQuery(struct event* e) {
  pthread_mutex_lock(&mu);
  int ok = e && event_slot(e) >= 0, pending = ok && e->pending;
  ++n_query;
  if (ok && (e->captured || unsafe_refused_locked())) {
    CUresult r = violation_locked(e->captured ? CAPTURED_EVENT : CAPTURE_IMPLICIT);
    pthread_mutex_unlock(&mu);
    return r;
  }
  pthread_mutex_unlock(&mu);
  return !ok ? INVALID_HANDLE : pending ? NOT_READY : SUCCESS;
}
CUresult cuEventSynchronize(struct event* e) {
  pthread_mutex_lock(&mu);
  int ok = e && event_slot(e) >= 0;
  if (ok && (e->captured || unsafe_refused_locked())) {
    CUresult r = violation_locked(e->captured ? CAPTURED_EVENT : CAPTURE_IMPLICIT);
    pthread_mutex_unlock(&mu);
    return r;
  }
  if (ok) {
    e->pending = 0;
    ++n_event_sync;
  }
  pthread_mutex_unlock(&mu);
  return ok ? SUCCESS : INVALID_HANDLE;
}
CUresult cuStreamWaitEvent(void* stream, struct event* e, unsigned flags) {
  (void)flags;
  if (!current) return INVALID_CONTEXT;
  pthread_mutex_lock(&mu);
  int ok = e && event_slot(e) >= 0;
  if (ok && e->captured && !capture_of_locked(stream)) {
    CUresult r = violation_locked(CAPTURED_EVENT);
    pthread_mutex_unlock(&mu);
    return r;
  }
  if (ok) ++n_wait;
  pthread_mutex_unlock(&mu);
  return ok ? SUCCESS : INVALID_HANDLE;
}
CUresult cuGetErrorName(CUresult r, const char** name) {
  switch (r) {
    case SUCCESS: *name = "CUDA_SUCCESS"; return SUCCESS;
    case INVALID_VALUE: *name = "CUDA_ERROR_INVALID_VALUE"; return SUCCESS;
    case OUT_OF_MEMORY: *name = "CUDA_ERROR_OUT_OF_MEMORY"; return SUCCESS;
    case INVALID_CONTEXT: *name = "CUDA_ERROR_INVALID_CONTEXT"; return SUCCESS;
    case INVALID_HANDLE: *name = "CUDA_ERROR_INVALID_HANDLE"; return SUCCESS;
    case NOT_READY: *name = "CUDA_ERROR_NOT_READY"; return SUCCESS;
    case 700: *name = "CUDA_ERROR_ILLEGAL_ADDRESS"; return SUCCESS;
    case CAPTURE_UNSUPPORTED: *name = "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"; return SUCCESS;
    case CAPTURE_IMPLICIT: *name = "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT"; return SUCCESS;
    case CAPTURED_EVENT: *name = "CUDA_ERROR_CAPTURED_EVENT"; return SUCCESS;
    default: return INVALID_VALUE;
  }
}

/* ---- virtual memory management (cuMemCreate & co.) -----------------------
 * Address ranges come from a region of their own, reserved PROT_NONE: a page
 * becomes readable and writable only once mapped and given access, and goes
 * back to PROT_NONE when unmapped, so a pointer into unmapped memory faults
 * like it would on a GPU. Physical allocations count against the capacity.
 * Any of these calls can be told to fail (fake_cuda_fail_vmm). */
#define GRANULARITY ((size_t)2 << 20)
#define VA_BYTES ((size_t)1 << 38)
#define MAX_RESERVATIONS 256
#define MAX_HANDLES 16384
enum { NOT_SUPPORTED = 801 };

struct reservation { char* base; size_t size; };
struct handle { size_t size; char* mapped_at; int live, released; };
static char* va;
static struct reservation reservations[MAX_RESERVATIONS];
static struct handle handles[MAX_HANDLES];
static int vmm_supported = 1;
static char fail_call[32];
static int fail_after, fail_code;
static long long n_va_reserve, n_va_free, n_create, n_release, n_map, n_unmap, n_access;

void fake_cuda_set_vmm(int on) { vmm_supported = on; }
void fake_cuda_reset_vmm_counters(void) {
  n_va_reserve = n_va_free = n_create = n_release = n_map = n_unmap = n_access = 0;
  fail_call[0] = 0;
}
/* The call named (e.g. "cuMemMap") fails with `code` after `after` more
 * successful calls of it; once. */
void fake_cuda_fail_vmm(const char* call, int after, int code) {
  pthread_mutex_lock(&mu);
  strncpy(fail_call, call, sizeof(fail_call) - 1);
  fail_after = after;
  fail_code = code;
  pthread_mutex_unlock(&mu);
}
long long fake_cuda_vmm_counter(const char* name) {
  long long live = 0, mapped = 0;
  for (int i = 0; i < MAX_HANDLES; ++i) {
    live += handles[i].live;
    mapped += handles[i].live && handles[i].mapped_at;
  }
  if (!strcmp(name, "va_reserve")) return n_va_reserve;
  if (!strcmp(name, "va_free")) return n_va_free;
  if (!strcmp(name, "create")) return n_create;
  if (!strcmp(name, "release")) return n_release;
  if (!strcmp(name, "map")) return n_map;
  if (!strcmp(name, "unmap")) return n_unmap;
  if (!strcmp(name, "set_access")) return n_access;
  if (!strcmp(name, "handles_live")) return live;
  if (!strcmp(name, "handles_mapped")) return mapped;
  return -1;
}
static int injected_failure_locked(const char* call) {
  if (!fail_call[0] || strcmp(fail_call, call)) return 0;
  if (fail_after-- > 0) return 0;
  fail_call[0] = 0;
  return fail_code;
}
static struct handle* handle_at_locked(char* p) {
  for (int i = 0; i < MAX_HANDLES; ++i)
    if (handles[i].live && handles[i].mapped_at == p) return &handles[i];
  return NULL;
}
static int reserved_locked(char* p, size_t size) {
  for (int i = 0; i < MAX_RESERVATIONS; ++i) {
    struct reservation* r = &reservations[i];
    if (r->base && p >= r->base && p + size <= r->base + r->size) return 1;
  }
  return 0;
}
static int overlaps_mapping_locked(char* p, size_t size) {
  for (int i = 0; i < MAX_HANDLES; ++i) {
    char* m = handles[i].mapped_at;
    if (handles[i].live && m && m < p + size && p < m + handles[i].size) return 1;
  }
  return 0;
}

typedef struct { int type, id; } CUmemLocation;
typedef struct {
  int type, requestedHandleTypes;
  CUmemLocation location;
  void* win32HandleMetaData;
  unsigned char allocFlags[8];
} CUmemAllocationProp;
typedef struct { CUmemLocation location; int flags; } CUmemAccessDesc;

CUresult cuMemGetAllocationGranularity(size_t* g, const CUmemAllocationProp* prop, int option) {
  (void)option;
  if (!vmm_supported) return NOT_SUPPORTED;
  if (!prop || prop->location.type != 1 || prop->location.id >= device_count) return INVALID_VALUE;
  *g = GRANULARITY;
  return SUCCESS;
}
CUresult cuMemAddressReserve(CUdeviceptr* out, size_t size, size_t align, CUdeviceptr addr,
                             unsigned long long flags) {
  (void)align, (void)addr, (void)flags;
  if (!current) return INVALID_CONTEXT;
  if (!size || size % GRANULARITY) return INVALID_VALUE;
  pthread_mutex_lock(&mu);
  CUresult r = injected_failure_locked("cuMemAddressReserve");
  if (!r && !va) {
    void* a = mmap(NULL, VA_BYTES, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (a == MAP_FAILED) r = OUT_OF_MEMORY;
    else va = (char*)(((size_t)a + GRANULARITY - 1) / GRANULARITY * GRANULARITY);
  }
  int slot = -1;
  char* best = NULL;
  for (int c = -1; !r && c < MAX_RESERVATIONS; ++c) {  /* lowest gap that fits */
    if (c >= 0 && !reservations[c].base) { if (slot < 0) slot = c; continue; }
    char* start = c < 0 ? va : reservations[c].base + reservations[c].size;
    if (start + size > va + VA_BYTES - GRANULARITY || (best && start >= best)) continue;
    int clear = 1;
    for (int i = 0; i < MAX_RESERVATIONS && clear; ++i) {
      struct reservation* q = &reservations[i];
      if (q->base && q->base < start + size && start < q->base + q->size) clear = 0;
    }
    if (clear) best = start;
  }
  if (!r && (!best || slot < 0)) r = OUT_OF_MEMORY;
  if (!r) {
    reservations[slot].base = best;
    reservations[slot].size = size;
    ++n_va_reserve;
    *out = (CUdeviceptr)(size_t)best;
  }
  pthread_mutex_unlock(&mu);
  return r;
}
CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
  pthread_mutex_lock(&mu);
  CUresult r = INVALID_VALUE;
  for (int i = 0; i < MAX_RESERVATIONS; ++i) {
    struct reservation* q = &reservations[i];
    if (q->base == (char*)(size_t)ptr && q->size == size) {
      if (overlaps_mapping_locked(q->base, size)) break; /* still mapped: refused */
      q->base = NULL;
      ++n_va_free;
      r = SUCCESS;
      break;
    }
  }
  pthread_mutex_unlock(&mu);
  return r;
}
CUresult cuMemCreate(unsigned long long* out, size_t size, const CUmemAllocationProp* prop,
                     unsigned long long flags) {
  (void)flags;
  if (!current) return INVALID_CONTEXT;
  if (!vmm_supported) return NOT_SUPPORTED;
  if (!size || size % GRANULARITY || !prop || prop->type != 1 || prop->location.type != 1)
    return INVALID_VALUE;
  pthread_mutex_lock(&mu);
  CUresult r = injected_failure_locked("cuMemCreate");
  if (!r && size > capacity - in_use) r = OUT_OF_MEMORY;
  int slot = -1;
  for (int i = 0; !r && i < MAX_HANDLES && slot < 0; ++i)
    if (!handles[i].live) slot = i;
  if (!r && slot < 0) r = OUT_OF_MEMORY;
  if (!r) {
    handles[slot] = (struct handle){size, NULL, 1, 0};
    in_use += size;
    ++n_create;
    *out = (unsigned long long)slot + 1;
  }
  pthread_mutex_unlock(&mu);
  return r;
}
static struct handle* handle_locked(unsigned long long h) {
  return h >= 1 && h <= MAX_HANDLES && handles[h - 1].live && !handles[h - 1].released
             ? &handles[h - 1] : NULL;
}
static void drop_locked(struct handle* h) { /* released and unmapped: the memory goes back */
  in_use -= h->size;
  h->live = 0;
}
CUresult cuMemRelease(unsigned long long hv) {
  pthread_mutex_lock(&mu);
  struct handle* h = handle_locked(hv);
  CUresult r = h ? injected_failure_locked("cuMemRelease") : INVALID_HANDLE;
  if (!r) {
    h->released = 1; /* as the driver: freed once unmapped too */
    if (!h->mapped_at) drop_locked(h);
    ++n_release;
  }
  pthread_mutex_unlock(&mu);
  return r;
}
CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, unsigned long long hv,
                  unsigned long long flags) {
  (void)flags;
  char* p = (char*)(size_t)ptr;
  pthread_mutex_lock(&mu);
  struct handle* h = handle_locked(hv);
  CUresult r = !h ? INVALID_HANDLE
               : offset || size != h->size || h->mapped_at || (size_t)p % GRANULARITY ||
                       !reserved_locked(p, size) || overlaps_mapping_locked(p, size)
                   ? INVALID_VALUE
                   : injected_failure_locked("cuMemMap");
  if (!r) {
    h->mapped_at = p;
    ++n_map;
  }
  pthread_mutex_unlock(&mu);
  return r;
}
CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc* desc, size_t count) {
  char* p = (char*)(size_t)ptr;
  pthread_mutex_lock(&mu);
  struct handle* h = handle_at_locked(p);
  CUresult r = !h || h->size != size || count != 1 || desc->flags != 3 ? INVALID_VALUE
                                                                       : injected_failure_locked("cuMemSetAccess");
  if (!r) {
    mprotect(p, size, PROT_READ | PROT_WRITE);
    ++n_access;
  }
  pthread_mutex_unlock(&mu);
  return r;
}
CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
  char* p = (char*)(size_t)ptr;
  pthread_mutex_lock(&mu);
  struct handle* h = handle_at_locked(p);
  CUresult r = !h || h->size != size ? INVALID_VALUE : injected_failure_locked("cuMemUnmap");
  if (!r) {
    madvise(p, size, MADV_DONTNEED); /* its bytes are gone */
    mprotect(p, size, PROT_NONE);
    h->mapped_at = NULL;
    if (h->released) drop_locked(h);
    ++n_unmap;
  }
  pthread_mutex_unlock(&mu);
  return r;
}

/* ---- what PyTorch asks the driver for itself (torch.cuda.init, with the
 * fake runtime, fake_cudart.c): every device's primary context is active. */
CUresult cuDevicePrimaryCtxGetState(int dev, unsigned* flags, int* active) {
  if (dev < 0 || dev >= device_count) return INVALID_VALUE;
  if (flags) *flags = 0;
  if (active) *active = 1;
  return SUCCESS;
}
CUresult cuGetErrorString(CUresult r, const char** text) { return cuGetErrorName(r, text); }
CUresult cuDriverGetVersion(int* version) {
  *version = 13000;
  return SUCCESS;
}
