// Test-only CUDA emulation: runs the device code of csrc/kernels/*.cuh on the CPU.
//
// Every CUDA thread of a block is a ucontext fiber. Fibers run cooperatively (in thread-index
// order, its reverse, or shuffled at every sweep, blocks shuffled too: emu_set_schedule), each
// until it reaches a barrier (__syncthreads, or a warp collective), so a kernel that
// forgets a barrier reads memory its peers have not written yet and computes a wrong result
// instead of passing by luck. Blocks run one after another. Shared memory is poisoned (0xFF
// bytes: -1 for integers, NaN for floats) at the start of every block, so reading it before
// writing it shows up too. A barrier that can never be released (divergent __syncthreads, a
// warp collective that not every live lane reaches) is reported as an error, not a hang, and so
// is what CUDA leaves undefined: __syncthreads after some threads of the block exited, a warp
// collective whose mask names a lane that exited or does not exist or whose lanes pass different
// masks, and launches past the real limits (block and grid dimensions, 48 KiB of shared memory
// without the opt-in no kernel here uses).
//
// Built with clang's load/store tracing (DARTREE_EMU_INSTRUMENTED, python_tests/emulated.py), every
// load and store of kernel code reports its address: accesses outside the emulator's own memory
// (fiber stacks, shared memory, the runtime's bookkeeping, the host stack, the library image) are
// global memory, counted per kernel and, when the caller registered its tensors' byte ranges,
// checked against them (GlobalMemory below; the callbacks are in emu_ops.cpp). The same build
// detects data races (RaceDetector below): two threads touching a byte of shared or global memory,
// at least one of them writing, with no barrier between them (__syncthreads; a warp collective for
// two lanes of one warp) is an error, and so is any such pair from two blocks of one launch.
// Atomics are exempt.
//
// Include this header before csrc/kernels/common.cuh. Launches from one OS thread at a time.
#pragma once

#define DARTREE_EMULATION 1

#include <dlfcn.h>
#include <link.h>
#include <pthread.h>
#include <ucontext.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct CUstream_st;
typedef struct CUstream_st* cudaStream_t;  // as the CUDA runtime defines it

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__

namespace dartree_emu {

constexpr int kWarpSize = 32;
constexpr unsigned char kSharedPoison = 0xFF;
// Guard zones around every shared-memory array (dynamic and static): filled with kSharedCanary
// before each block, checked after it; a changed byte is an out-of-bounds shared-memory write.
constexpr size_t kSharedGuardBytes = 256;
constexpr unsigned char kSharedCanary = 0xA5;
constexpr size_t kFiberStackBytes = 128 * 1024;
constexpr unsigned kMaxThreadsPerBlock = 1024;
// What a block gets without opting in (cudaFuncAttributeMaxDynamicSharedMemorySize, which no
// kernel here uses): 48 KiB of static + dynamic shared memory on every arch we build for.
constexpr size_t kMaxSharedBytes = 48 * 1024;
constexpr unsigned kMaxBlockDim[3] = {1024, 1024, 64};
constexpr unsigned long long kMaxGridDim[3] = {2147483647ull, 65535ull, 65535ull};

enum class FiberState { kReady, kAtBlockBarrier, kAtWarpBarrier, kDone };

// The order in which ready threads run between barriers. Any order is a legal CUDA schedule;
// forward order makes a missing barrier fail reliably in reduction-like code, a shuffled order
// (re-drawn at every sweep) catches races that forward order happens to hide.
enum class Schedule { kForward = 0, kReverse = 1, kShuffled = 2 };

struct Fiber {
  ucontext_t context;
  FiberState state = FiberState::kReady;
  dim3 thread_idx;
  unsigned linear = 0;  // threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z)
  unsigned warp_mask = 0;  // the mask of the warp collective this thread waits at
};

// What the instrumented build's callbacks call per access: inlined into them, so not itself traced.
#define DARTREE_EMU_HOT inline __attribute__((always_inline))

struct AddressRange {
  uintptr_t begin = 0, end = 0;
  DARTREE_EMU_HOT bool holds(uintptr_t address, size_t bytes) const {
    return address >= begin && address + bytes <= end;
  }
};

template <typename T>
DARTREE_EMU_HOT AddressRange range_of(const std::vector<T>& v) {
  const uintptr_t begin = reinterpret_cast<uintptr_t>(v.data());
  return {begin, begin + v.capacity() * sizeof(T)};
}

struct KernelTraffic {
  uint64_t launches = 0, read_bytes = 0, write_bytes = 0;
};

struct OutOfBoundsAccess {
  bool found = false;
  bool write = false;
  uintptr_t address = 0;
  size_t bytes = 0;
  dim3 block, thread;
};

// Race detection (instrumented build). Every byte of shared memory keeps a stamp of its last write
// and its last read; every byte of global memory, of its last write (global reads are not
// stamped: a read by one thread and a later write by another are seen when the shuffled schedule
// runs the write first, which is also a legal CUDA order). Two accesses are ordered when one
// thread made both, or a __syncthreads was released between them in their block, or the two
// threads are lanes of one warp and a warp collective of that warp was released between them.
// Accesses of different blocks of one launch are never ordered. Stamps of an earlier block
// (shared) or launch (global) do not count: `generation` tells them apart.
struct AccessStamp {
  uint32_t generation = 0;  // 0: never accessed
  uint32_t block = 0;       // linear block index
  uint32_t thread = 0;      // linear thread index in the block
  uint32_t epoch = 0;       // the block's released __syncthreads at the access
  uint32_t warp_epoch = 0;  // the thread's warp's released collectives at the access
};

struct SharedShadow {
  std::vector<AccessStamp> writes, reads;  // one per payload byte
};

struct DataRace {
  bool found = false;
  bool shared = false, write = false, earlier_write = false;
  size_t offset = 0;        // shared: byte of the array; global: the address
  int array = 0;            // shared: 0 the dynamic shared memory, else a static array
  uint32_t block = 0, thread = 0, earlier_block = 0, earlier_thread = 0;
};

constexpr size_t kGlobalShadowPageBytes = 4096;

struct RaceDetector {
  bool enabled = true;
  bool in_atomic = false;             // inside an emulated atomic: exempt
  uint32_t launch_generation = 0;     // global stamps
  uint32_t block_generation = 0;      // shared stamps
  uint32_t block_linear = 0;
  uint32_t block_epoch = 0;
  std::vector<uint32_t> warp_epochs;  // per warp of the block
  SharedShadow dynamic_shadow;
  std::vector<SharedShadow> static_shadows;  // parallel to Runtime::static_shared
  std::map<uintptr_t, std::unique_ptr<AccessStamp[]>> global_pages;  // write stamps, per 4 KiB page
  DataRace race;                      // the launch's first
  std::string shared_out_of_bounds;   // the launch's first shared access into a guard zone
};

// Global-memory accounting. Launches are counted in every build; bytes and bounds only in the
// instrumented one, whose callbacks see kernel code's loads and stores while `in_kernel` is set
// (host code of the launchers and the scheduler is not the kernel's traffic).
// An out-of-bounds access that lands in emulator-owned memory (another heap block of the
// runtime's) is not seen: the check is as good as the distance between tensors and that memory.
struct GlobalMemory {
  bool in_kernel = false;
  KernelTraffic launch;                             // the current launch
  std::map<std::string, KernelTraffic> per_kernel;  // every launch so far, by kernel name
  std::vector<AddressRange> registered;             // sorted by begin; checked when `checking`
  bool checking = false;
  OutOfBoundsAccess out_of_bounds;                  // the first one of the launch
  AddressRange host_stack;                          // of the launching OS thread
  pthread_t host_thread{};
  bool host_stack_known = false;
  std::vector<AddressRange> image;                  // the library's loaded segments
};

struct StaticShared {
  const void* key;
  std::vector<unsigned char> bytes;  // guards included
};

struct Runtime {
  std::mutex launch_mutex;
  dim3 grid, block, block_idx;
  std::vector<Fiber> fibers;
  std::unique_ptr<char[]> stack_arena;  // kFiberStackBytes per thread, one allocation
  size_t stack_arena_threads = 0;
  ucontext_t scheduler;
  Fiber* current = nullptr;
  void (*body)(const void*) = nullptr;  // runs the launch's closure, which lives on the host stack
  const void* body_closure = nullptr;
  const char* kernel_name = "";
  std::vector<unsigned char> dynamic_shared;
  std::vector<StaticShared> static_shared;
  std::vector<uint64_t> exchange;  // one slot per thread, for warp collectives
  size_t static_shared_bytes = 0;
  std::string error;
  Schedule schedule = Schedule::kForward;
  std::mt19937_64 rng{0};
  std::vector<unsigned> order;
  GlobalMemory memory;
  RaceDetector races;
};

// A namespace-scope object, not a function-local static: its accesses from kernel code need no
// initialization guard (a load the instrumented build would have to classify).
inline Runtime runtime_instance;

DARTREE_EMU_HOT Runtime& runtime() { return runtime_instance; }

inline Fiber& self() { return *runtime().current; }

inline void yield_to_scheduler() {
  Runtime& rt = runtime();
  swapcontext(&rt.current->context, &rt.scheduler);
}

inline void block_barrier() {
  self().state = FiberState::kAtBlockBarrier;
  yield_to_scheduler();
}

inline void warp_barrier(unsigned mask = 0xffffffffu) {
  self().state = FiberState::kAtWarpBarrier;
  self().warp_mask = mask;
  yield_to_scheduler();
}

inline void fiber_entry() {
  Runtime& rt = runtime();
  rt.body(rt.body_closure);
  rt.current->state = FiberState::kDone;
  // returning resumes uc_link, the scheduler
}

// Releases every barrier that all of its live participants have reached. Returns whether
// anything was released.
inline bool release_barriers(Runtime& rt) {
  const size_t n = rt.fibers.size();
  size_t live = 0, at_block = 0;
  for (const Fiber& f : rt.fibers) {
    if (f.state != FiberState::kDone) ++live;
    if (f.state == FiberState::kAtBlockBarrier) ++at_block;
  }
  bool released = false;
  if (live > 0 && at_block == live) {
    if (live < n) {  // CUDA: every thread of the block must reach __syncthreads (exited ones cannot)
      rt.error = "__syncthreads reached after " + std::to_string(n - live) + " of the block's " + std::to_string(n) +
                 " threads exited";
      return false;
    }
    for (Fiber& f : rt.fibers)
      if (f.state == FiberState::kAtBlockBarrier) f.state = FiberState::kReady;
    ++rt.races.block_epoch;
    released = true;
  }
  for (size_t base = 0; base < n; base += kWarpSize) {
    size_t end = base + kWarpSize < n ? base + kWarpSize : n;
    size_t warp_live = 0, warp_waiting = 0;
    for (size_t i = base; i < end; ++i) {
      if (rt.fibers[i].state != FiberState::kDone) ++warp_live;
      if (rt.fibers[i].state == FiberState::kAtWarpBarrier) ++warp_waiting;
    }
    if (warp_live > 0 && warp_waiting == warp_live) {
      // every waiting lane names the same mask, and every lane of the mask exists and is waiting
      unsigned mask = 0;
      bool first = true;
      for (size_t i = base; i < end; ++i) {
        const Fiber& f = rt.fibers[i];
        if (f.state != FiberState::kAtWarpBarrier) continue;
        if (!first && f.warp_mask != mask) {
          rt.error = "warp collective: lanes of warp " + std::to_string(base / kWarpSize) + " pass different masks";
          return false;
        }
        mask = f.warp_mask;
        first = false;
      }
      for (unsigned lane = 0; lane < static_cast<unsigned>(kWarpSize); ++lane) {
        if (!(mask >> lane & 1u)) continue;
        const size_t i = base + lane;
        if (i >= end || rt.fibers[i].state != FiberState::kAtWarpBarrier) {
          rt.error = "warp collective: lane " + std::to_string(lane) + " of warp " + std::to_string(base / kWarpSize) +
                     (i >= end ? " is in the mask but does not exist (partial warp)" : " is in the mask but exited");
          return false;
        }
      }
      for (size_t i = base; i < end; ++i)
        if (rt.fibers[i].state == FiberState::kAtWarpBarrier) rt.fibers[i].state = FiberState::kReady;
      ++rt.races.warp_epochs[base / kWarpSize];
      released = true;
    }
  }
  return released;
}

// The shared-memory buffers of the current launch, guards included.
inline std::vector<std::vector<unsigned char>*> shared_regions(Runtime& rt) {
  std::vector<std::vector<unsigned char>*> regions{&rt.dynamic_shared};
  for (auto& array : rt.static_shared) regions.push_back(&array.bytes);
  return regions;
}

// Whether [address, address + bytes) is the emulator's own memory rather than global memory:
// fiber stacks, shared memory with its guards, the runtime and its vectors, the launching
// thread's stack (the launch closure, the launchers' locals) and the library's image.
DARTREE_EMU_HOT bool emulator_owned(const Runtime& rt, uintptr_t address, size_t bytes) {
  const uintptr_t arena = reinterpret_cast<uintptr_t>(rt.stack_arena.get());
  if (address >= arena && address + bytes <= arena + rt.stack_arena_threads * kFiberStackBytes) return true;
  if (range_of(rt.dynamic_shared).holds(address, bytes)) return true;
  for (const StaticShared& array : rt.static_shared)
    if (range_of(array.bytes).holds(address, bytes)) return true;
  const uintptr_t self_begin = reinterpret_cast<uintptr_t>(&rt);
  if (address >= self_begin && address + bytes <= self_begin + sizeof(Runtime)) return true;
  if (range_of(rt.static_shared).holds(address, bytes) || range_of(rt.fibers).holds(address, bytes) ||
      range_of(rt.exchange).holds(address, bytes) || range_of(rt.order).holds(address, bytes))
    return true;
  if (rt.memory.host_stack.holds(address, bytes)) return true;
  for (const AddressRange& segment : rt.memory.image)
    if (segment.holds(address, bytes)) return true;
  return false;
}

// The registered range holding the access, or null (ranges sorted by begin).
DARTREE_EMU_HOT const AddressRange* registered_range(const GlobalMemory& memory, uintptr_t address, size_t bytes) {
  auto after = std::upper_bound(memory.registered.begin(), memory.registered.end(), address,
                                [](uintptr_t a, const AddressRange& r) { return a < r.begin; });
  if (after == memory.registered.begin()) return nullptr;
  const AddressRange& candidate = *(after - 1);
  return candidate.holds(address, bytes) ? &candidate : nullptr;
}

// Whether an earlier access (its stamp) happens before the current thread's access.
DARTREE_EMU_HOT bool happens_before(const RaceDetector& d, const AccessStamp& earlier, uint32_t thread) {
  if (earlier.block != d.block_linear) return false;  // two blocks of one launch: never ordered
  if (earlier.thread == thread || earlier.epoch < d.block_epoch) return true;
  return earlier.thread / kWarpSize == thread / kWarpSize &&
         earlier.warp_epoch < d.warp_epochs[thread / kWarpSize];
}

DARTREE_EMU_HOT AccessStamp stamp_now(const RaceDetector& d, uint32_t generation, uint32_t thread) {
  return {generation, d.block_linear, thread, d.block_epoch, d.warp_epochs[thread / kWarpSize]};
}

// An access to shared memory (payload bytes of the dynamic array, index 0, or of a static one):
// checked against the bytes' last write and, for a write, last read; then stamped.
inline void shared_race_check(RaceDetector& d, SharedShadow& shadow, int array, size_t offset, size_t bytes,
                              bool write, uint32_t thread) {
  const AccessStamp now = stamp_now(d, d.block_generation, thread);
  const size_t end = std::min(offset + bytes, shadow.writes.size());
  for (size_t i = offset; i < end; ++i) {
    AccessStamp& last_write = shadow.writes[i];
    AccessStamp& last_read = shadow.reads[i];
    if (!d.race.found) {
      const AccessStamp* earlier = nullptr;
      bool earlier_write = true;
      if (last_write.generation == now.generation && !happens_before(d, last_write, thread)) {
        earlier = &last_write;
      } else if (write && last_read.generation == now.generation && !happens_before(d, last_read, thread)) {
        earlier = &last_read;
        earlier_write = false;
      }
      if (earlier)
        d.race = {true, true, write, earlier_write, i, array, now.block, thread, earlier->block, earlier->thread};
    }
    (write ? last_write : last_read) = now;
  }
}

// Shared memory: race-checked here (returns true); anything else returns false.
inline bool shared_access(Runtime& rt, uintptr_t address, size_t bytes, bool write, bool check) {
  auto payload_offset = [&](const std::vector<unsigned char>& region, size_t& offset) {
    const uintptr_t begin = reinterpret_cast<uintptr_t>(region.data());
    if (address < begin || address >= begin + region.size()) return false;
    offset = address - begin;
    return true;
  };
  size_t offset = 0;
  SharedShadow* shadow = nullptr;
  int array = 0;
  if (payload_offset(rt.dynamic_shared, offset)) {
    shadow = &rt.races.dynamic_shadow;
  } else {
    for (size_t a = 0; a < rt.static_shared.size() && !shadow; ++a)
      if (payload_offset(rt.static_shared[a].bytes, offset) && a < rt.races.static_shadows.size())
        shadow = &rt.races.static_shadows[a], array = static_cast<int>(a) + 1;
    if (!shadow) return false;
  }
  const std::vector<unsigned char>& region = array == 0 ? rt.dynamic_shared : rt.static_shared[array - 1].bytes;
  const size_t payload = region.size() - 2 * kSharedGuardBytes;
  if (offset < kSharedGuardBytes || offset + bytes > kSharedGuardBytes + payload) {  // a guard zone
    if (rt.races.shared_out_of_bounds.empty() && rt.current) {
      const long long at = static_cast<long long>(offset) - static_cast<long long>(kSharedGuardBytes);
      rt.races.shared_out_of_bounds =
          std::string("shared memory ") + (write ? "write" : "read") + " out of bounds in " + rt.kernel_name +
          ": byte " + std::to_string(at) + " of " +
          (array == 0 ? "the dynamic shared memory" : "a static shared array") + " (" + std::to_string(payload) + " bytes), thread " + std::to_string(rt.current->linear) + " of block " +
          std::to_string(rt.races.block_linear);
    }
    return true;
  }
  if (check) shared_race_check(rt.races, *shadow, array, offset - kSharedGuardBytes, bytes, write, rt.current->linear);
  return true;
}

// An access to global memory: checked against the bytes' last write in this launch; a write is stamped.
inline void global_race_check(RaceDetector& d, uintptr_t address, size_t bytes, bool write, uint32_t thread) {
  const AccessStamp now = stamp_now(d, d.launch_generation, thread);
  for (uintptr_t a = address; a < address + bytes; ++a) {
    const uintptr_t page = a / kGlobalShadowPageBytes;
    auto it = d.global_pages.find(page);
    if (it == d.global_pages.end()) {
      if (!write) continue;  // not written in this launch
      it = d.global_pages.emplace(page, std::make_unique<AccessStamp[]>(kGlobalShadowPageBytes)).first;
    }
    AccessStamp& last_write = it->second[a % kGlobalShadowPageBytes];
    if (!d.race.found && last_write.generation == now.generation && !happens_before(d, last_write, thread))
      d.race = {true, false, write, true, a, 0, now.block, thread, last_write.block, last_write.thread};
    if (write) last_write = now;
  }
}

// One access of kernel code, from the instrumented build's callbacks (which clear `in_kernel`
// around it, so anything here that is itself instrumented does not recurse).
DARTREE_EMU_HOT void record_access(Runtime& rt, const void* pointer, size_t bytes, bool write) {
  GlobalMemory& memory = rt.memory;
  const uintptr_t address = reinterpret_cast<uintptr_t>(pointer);
  const bool racing = rt.races.enabled && !rt.races.in_atomic && rt.current != nullptr;
  if (shared_access(rt, address, bytes, write, racing)) return;
  if (emulator_owned(rt, address, bytes)) return;
  (write ? memory.launch.write_bytes : memory.launch.read_bytes) += bytes;
  if (memory.checking && !memory.out_of_bounds.found && !registered_range(memory, address, bytes))
    memory.out_of_bounds = {true, write, address, bytes, rt.block_idx, rt.current ? rt.current->thread_idx : dim3()};
  if (racing) global_race_check(rt.races, address, bytes, write, rt.current->linear);
}

inline std::string hex_address(uintptr_t address);

// The error for the launch's first data race.
inline std::string race_message(const Runtime& rt) {
  const DataRace& r = rt.races.race;
  const std::string who = "thread " + std::to_string(r.thread) + " of block " + std::to_string(r.block);
  const std::string what = r.shared ? "byte " + std::to_string(r.offset) + " of " +
                                          (r.array == 0 ? std::string("the dynamic shared memory")
                                                        : "static shared array " + std::to_string(r.array - 1))
                                    : "global memory at " + hex_address(r.offset);
  const std::string other = r.earlier_block == r.block
                                ? "thread " + std::to_string(r.earlier_thread) + " of the same block"
                                : "thread " + std::to_string(r.earlier_thread) + " of block " +
                                      std::to_string(r.earlier_block) + " (blocks of one launch are unordered)";
  return std::string("data race in ") + rt.kernel_name + ": " + who + (r.write ? " writes " : " reads ") + what +
         ", which " + other + (r.earlier_write ? " wrote" : " read") +
         " with no barrier between them (__syncthreads, or a warp collective between lanes of one warp)";
}

inline std::string hex_address(uintptr_t address) {
  char text[32];
  std::snprintf(text, sizeof(text), "0x%llx", static_cast<unsigned long long>(address));
  return text;
}

// The error for the launch's first out-of-bounds access, naming the registered range nearest to it.
inline std::string out_of_bounds_message(const Runtime& rt) {
  const OutOfBoundsAccess& oob = rt.memory.out_of_bounds;
  std::string message = std::string("global memory ") + (oob.write ? "write" : "read") + " out of bounds in " +
                        rt.kernel_name + ", block (" + std::to_string(oob.block.x) + ", " +
                        std::to_string(oob.block.y) + ", " + std::to_string(oob.block.z) + "), thread (" +
                        std::to_string(oob.thread.x) + ", " + std::to_string(oob.thread.y) + ", " +
                        std::to_string(oob.thread.z) + "): " + std::to_string(oob.bytes) + " bytes at " +
                        hex_address(oob.address);
  const AddressRange* nearest = nullptr;
  uintptr_t best = UINTPTR_MAX;
  for (const AddressRange& r : rt.memory.registered) {
    const uintptr_t distance = oob.address < r.begin ? r.begin - oob.address
                               : oob.address >= r.end ? oob.address - r.end : 0;
    if (distance < best) best = distance, nearest = &r;
  }
  if (!nearest) return message + ", and no range is registered";
  const size_t size = nearest->end - nearest->begin;
  const std::string where = oob.address < nearest->begin
                                ? std::to_string(nearest->begin - oob.address) + " bytes before the start of"
                                : "byte " + std::to_string(oob.address - nearest->begin) + " of";
  return message + ", " + where + " the nearest registered range [" + hex_address(nearest->begin) + ", " +
         hex_address(nearest->end) + ") (" + std::to_string(size) + " bytes)";
}

// The launching thread's stack and the library's segments: emulator-owned for the classification.
inline void locate_host_memory(GlobalMemory& memory) {
  const pthread_t me = pthread_self();
  if (!memory.host_stack_known || !pthread_equal(me, memory.host_thread)) {
    pthread_attr_t attr;
    void* base = nullptr;
    size_t size = 0;
    if (pthread_getattr_np(me, &attr) == 0) {
      pthread_attr_getstack(&attr, &base, &size);
      pthread_attr_destroy(&attr);
    }
    memory.host_stack = {reinterpret_cast<uintptr_t>(base), reinterpret_cast<uintptr_t>(base) + size};
    memory.host_thread = me;
    memory.host_stack_known = true;
  }
  if (!memory.image.empty()) return;
  Dl_info info;
  if (dladdr(reinterpret_cast<const void*>(&runtime_instance), &info) == 0) return;
  struct Search {
    uintptr_t base;
    std::vector<AddressRange>* out;
  } search{reinterpret_cast<uintptr_t>(info.dli_fbase), &memory.image};
  dl_iterate_phdr(
      [](dl_phdr_info* object, size_t, void* data) -> int {
        auto* s = static_cast<Search*>(data);
        if (object->dlpi_addr != s->base) return 0;
        for (int i = 0; i < object->dlpi_phnum; ++i) {
          const ElfW(Phdr)& h = object->dlpi_phdr[i];
          if (h.p_type == PT_LOAD)
            s->out->push_back({object->dlpi_addr + h.p_vaddr, object->dlpi_addr + h.p_vaddr + h.p_memsz});
        }
        return 1;
      },
      &search);
}

inline void check_shared_guards(Runtime& rt) {
  auto regions = shared_regions(rt);
  for (size_t r = 0; r < regions.size(); ++r) {
    const auto& bytes = *regions[r];
    const size_t payload = bytes.size() - 2 * kSharedGuardBytes;
    for (size_t i = 0; i < bytes.size(); ++i) {
      if (i >= kSharedGuardBytes && i < kSharedGuardBytes + payload) continue;
      if (bytes[i] == kSharedCanary) continue;
      const long long offset = i < kSharedGuardBytes ? static_cast<long long>(i) - static_cast<long long>(kSharedGuardBytes)
                                                     : static_cast<long long>(i - kSharedGuardBytes);
      rt.error = std::string("shared memory written out of bounds: byte ") + std::to_string(offset) + " of " +
                 (r == 0 ? "the dynamic shared memory" : "a static shared array") + " (" + std::to_string(payload) +
                 " bytes), in block (" + std::to_string(rt.block_idx.x) + ", " + std::to_string(rt.block_idx.y) +
                 ", " + std::to_string(rt.block_idx.z) + ")";
      return;
    }
  }
}

inline void run_block(Runtime& rt) {
  const unsigned nthreads = rt.block.x * rt.block.y * rt.block.z;
  rt.fibers.assign(nthreads, Fiber{});
  if (rt.stack_arena_threads < nthreads) {
    rt.stack_arena.reset(new char[nthreads * kFiberStackBytes]);
    rt.stack_arena_threads = nthreads;
  }
  rt.exchange.assign(nthreads, 0);
  RaceDetector& races = rt.races;
  ++races.block_generation;
  races.block_linear = rt.block_idx.x + rt.grid.x * (rt.block_idx.y + rt.grid.y * rt.block_idx.z);
  races.block_epoch = 0;
  races.warp_epochs.assign((nthreads + kWarpSize - 1) / kWarpSize, 0);
  for (auto* region : shared_regions(rt)) {
    std::memset(region->data(), kSharedCanary, region->size());
    std::memset(region->data() + kSharedGuardBytes, kSharedPoison, region->size() - 2 * kSharedGuardBytes);
  }
  for (unsigned t = 0; t < nthreads; ++t) {
    Fiber& f = rt.fibers[t];
    f.linear = t;
    f.thread_idx = dim3(t % rt.block.x, (t / rt.block.x) % rt.block.y, t / (rt.block.x * rt.block.y));
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = rt.stack_arena.get() + t * kFiberStackBytes;
    f.context.uc_stack.ss_size = kFiberStackBytes;
    f.context.uc_link = &rt.scheduler;
    makecontext(&f.context, fiber_entry, 0);
  }
  rt.order.resize(nthreads);
  std::iota(rt.order.begin(), rt.order.end(), 0u);
  if (rt.schedule == Schedule::kReverse) std::reverse(rt.order.begin(), rt.order.end());
  for (;;) {
    bool ran = false;
    if (rt.schedule == Schedule::kShuffled) std::shuffle(rt.order.begin(), rt.order.end(), rt.rng);
    for (unsigned t : rt.order) {
      Fiber& f = rt.fibers[t];
      if (f.state != FiberState::kReady) continue;
      rt.current = &f;
      rt.memory.in_kernel = true;
      swapcontext(&rt.scheduler, &f.context);
      rt.memory.in_kernel = false;
      ran = true;
    }
    bool all_done = true;
    for (const Fiber& f : rt.fibers) all_done = all_done && f.state == FiberState::kDone;
    if (all_done) {
      check_shared_guards(rt);
      return;
    }
    const bool released = release_barriers(rt);
    if (!rt.error.empty()) return;  // a misused barrier or collective (the fibers are abandoned)
    if (!released && !ran) {
      rt.error = "deadlock: no thread can proceed (a barrier or warp collective that some live "
                 "thread never reaches)";
      return;
    }
  }
}

// Runs `closure(closure_data)` as every thread of every block. `kernel_name` names the launch in
// the traffic counters and errors.
inline void launch_closure(dim3 grid, dim3 block, size_t dynamic_shared_bytes, const char* kernel_name,
                           void (*closure)(const void*), const void* closure_data) {
  Runtime& rt = runtime();
  std::lock_guard<std::mutex> lock(rt.launch_mutex);
  const unsigned long long nthreads = 1ull * block.x * block.y * block.z;
  if (nthreads == 0 || nthreads > kMaxThreadsPerBlock)
    throw std::invalid_argument("emulated launch: block must have 1..1024 threads, got " + std::to_string(nthreads));
  const unsigned bdim[3] = {block.x, block.y, block.z};
  const unsigned gdim[3] = {grid.x, grid.y, grid.z};
  for (int d = 0; d < 3; ++d) {
    if (bdim[d] > kMaxBlockDim[d])
      throw std::invalid_argument("emulated launch: blockDim." + std::string(1, "xyz"[d]) + " = " +
                                  std::to_string(bdim[d]) + " exceeds " + std::to_string(kMaxBlockDim[d]));
    if (gdim[d] == 0 || gdim[d] > kMaxGridDim[d])
      throw std::invalid_argument("emulated launch: gridDim." + std::string(1, "xyz"[d]) + " = " +
                                  std::to_string(gdim[d]) + " outside 1.." + std::to_string(kMaxGridDim[d]));
  }
  if (dynamic_shared_bytes > kMaxSharedBytes)
    throw std::invalid_argument("emulated launch: " + std::to_string(dynamic_shared_bytes) +
                                " bytes of dynamic shared memory exceed the 49152 a block gets without opting in");
  rt.grid = grid;
  rt.block = block;
  rt.body = closure;
  rt.body_closure = closure_data;
  rt.kernel_name = kernel_name;
#ifdef DARTREE_EMU_INSTRUMENTED
  locate_host_memory(rt.memory);
#endif
  rt.memory.launch = KernelTraffic{1, 0, 0};
  rt.memory.out_of_bounds = OutOfBoundsAccess{};
  rt.dynamic_shared.assign(dynamic_shared_bytes + 2 * kSharedGuardBytes, kSharedPoison);
  rt.static_shared.clear();
  rt.races.race = DataRace{};
  rt.races.shared_out_of_bounds.clear();
  ++rt.races.launch_generation;
  rt.races.global_pages.clear();
  rt.races.static_shadows.clear();
  rt.races.dynamic_shadow.writes.assign(dynamic_shared_bytes, AccessStamp{});
  rt.races.dynamic_shadow.reads.assign(dynamic_shared_bytes, AccessStamp{});
  rt.static_shared_bytes = 0;
  rt.error.clear();
  // blocks run one after another, in index order, or in a shuffled order under the shuffled
  // schedule (CUDA promises no order between blocks)
  std::vector<dim3> blocks;
  blocks.reserve(static_cast<size_t>(grid.x) * grid.y * grid.z);
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) blocks.emplace_back(x, y, z);
  if (rt.schedule == Schedule::kShuffled) std::shuffle(blocks.begin(), blocks.end(), rt.rng);
  for (const dim3& b : blocks) {
    if (!rt.error.empty()) break;
    rt.block_idx = b;
    run_block(rt);
  }
  rt.current = nullptr;
  rt.body = nullptr;
  rt.body_closure = nullptr;
  KernelTraffic& total = rt.memory.per_kernel[kernel_name];
  total.launches += rt.memory.launch.launches;
  total.read_bytes += rt.memory.launch.read_bytes;
  total.write_bytes += rt.memory.launch.write_bytes;
  if (rt.error.empty() && rt.memory.out_of_bounds.found) rt.error = out_of_bounds_message(rt);
  if (!rt.races.shared_out_of_bounds.empty()) rt.error = rt.races.shared_out_of_bounds;  // before its canary
  if (rt.error.empty() && rt.races.race.found) rt.error = race_message(rt);
  rt.races.global_pages.clear();
  if (!rt.error.empty()) throw std::runtime_error("emulated kernel failed: " + rt.error);
}

// The launch's closure stays on the host stack (no std::function heap copy), so the kernel's
// reads of its arguments are the emulator's, not global memory.
template <typename Closure>
void launch(dim3 grid, dim3 block, size_t dynamic_shared_bytes, const char* kernel_name, const Closure& body) {
  launch_closure(grid, block, dynamic_shared_bytes, kernel_name,
                 [](const void* data) { (*static_cast<const Closure*>(data))(); }, &body);
}

inline void set_schedule(Schedule schedule, uint64_t seed) {
  Runtime& rt = runtime();
  std::lock_guard<std::mutex> lock(rt.launch_mutex);
  rt.schedule = schedule;
  rt.rng.seed(seed);
}

// Per-block static shared array, keyed by its declaration site.
template <typename T>
T* static_shared_array(const void* key, size_t count) {
  Runtime& rt = runtime();
  auto it = std::find_if(rt.static_shared.begin(), rt.static_shared.end(),
                         [key](const StaticShared& array) { return array.key == key; });
  if (it == rt.static_shared.end()) {
    // the runtime's own allocation, not the kernel's traffic (the vectors are not owned ranges yet)
    rt.memory.in_kernel = false;
    rt.static_shared_bytes += sizeof(T) * count;
    if (rt.static_shared_bytes + rt.dynamic_shared.size() - 2 * kSharedGuardBytes > kMaxSharedBytes)
      throw std::runtime_error("emulated kernel: shared memory exceeds the device limit");
    std::vector<unsigned char> bytes(sizeof(T) * count + 2 * kSharedGuardBytes, kSharedPoison);
    std::memset(bytes.data(), kSharedCanary, kSharedGuardBytes);
    std::memset(bytes.data() + bytes.size() - kSharedGuardBytes, kSharedCanary, kSharedGuardBytes);
    rt.static_shared.push_back(StaticShared{key, std::move(bytes)});
    rt.races.static_shadows.emplace_back();
    rt.races.static_shadows.back().writes.assign(sizeof(T) * count, AccessStamp{});
    rt.races.static_shadows.back().reads.assign(sizeof(T) * count, AccessStamp{});
    it = rt.static_shared.end() - 1;
    rt.memory.in_kernel = true;
  }
  return reinterpret_cast<T*>(it->bytes.data() + kSharedGuardBytes);
}

// Warp exchange: every live lane publishes a value, waits for the warp, reads, waits again so the
// slots are not overwritten before everybody has read them.
template <typename T, typename SourceLane>
T warp_exchange(T value, SourceLane source_lane, unsigned mask) {
  static_assert(sizeof(T) <= sizeof(uint64_t) && std::is_trivially_copyable<T>::value,
                "emulated shuffles move at most 8 bytes");
  Runtime& rt = runtime();
  const unsigned me = self().linear;
  const unsigned warp_base = me - me % kWarpSize;
  uint64_t slot = 0;
  std::memcpy(&slot, &value, sizeof(T));
  rt.exchange[me] = slot;
  warp_barrier(mask);
  int src = source_lane(static_cast<int>(me % kWarpSize));
  T out = value;
  const unsigned src_linear = warp_base + static_cast<unsigned>(src);
  if (src >= 0 && src < kWarpSize && src_linear < rt.fibers.size())
    std::memcpy(&out, &rt.exchange[src_linear], sizeof(T));
  warp_barrier(mask);
  return out;
}

}  // namespace dartree_emu

#define threadIdx (::dartree_emu::self().thread_idx)
#define blockIdx (::dartree_emu::runtime().block_idx)
#define blockDim (::dartree_emu::runtime().block)
#define gridDim (::dartree_emu::runtime().grid)
#define warpSize 32

inline void __syncthreads() { ::dartree_emu::block_barrier(); }
namespace dartree_emu {
// __syncthreads_or / _and / _count: every thread publishes its predicate, the block meets, each
// reads all of them, and the block meets again before the slots can be reused.
inline int block_vote(int predicate, int kind) {
  Runtime& rt = runtime();
  rt.exchange[self().linear] = predicate != 0;
  block_barrier();
  int count = 0;
  for (uint64_t v : rt.exchange) count += static_cast<int>(v);
  block_barrier();
  const int threads = static_cast<int>(rt.exchange.size());
  return kind == 0 ? count > 0 : kind == 1 ? count == threads : count;
}
}  // namespace dartree_emu
inline int __syncthreads_or(int predicate) { return ::dartree_emu::block_vote(predicate, 0); }
inline int __syncthreads_and(int predicate) { return ::dartree_emu::block_vote(predicate, 1); }
inline int __syncthreads_count(int predicate) { return ::dartree_emu::block_vote(predicate, 2); }
inline void __syncwarp(unsigned mask = 0xffffffffu) { ::dartree_emu::warp_barrier(mask); }
inline void __threadfence() {}
inline void __threadfence_block() {}

template <typename T>
T __shfl_sync(unsigned mask, T var, int src_lane, int width = 32) {
  return ::dartree_emu::warp_exchange(var, [&](int lane) { return lane - lane % width + src_lane % width; }, mask);
}
template <typename T>
T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  return ::dartree_emu::warp_exchange(
      var, [&](int lane) { return lane % width + static_cast<int>(delta) < width ? lane + static_cast<int>(delta) : lane; },
      mask);
}
template <typename T>
T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  return ::dartree_emu::warp_exchange(
      var, [&](int lane) { return lane % width >= static_cast<int>(delta) ? lane - static_cast<int>(delta) : lane; },
      mask);
}
template <typename T>
T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32) {
  return ::dartree_emu::warp_exchange(
      var, [&](int lane) { int src = lane ^ lane_mask; return src / width == lane / width ? src : lane; }, mask);
}

inline unsigned __ballot_sync(unsigned mask, int predicate) {
  ::dartree_emu::Runtime& rt = ::dartree_emu::runtime();
  const unsigned me = ::dartree_emu::self().linear;
  const unsigned warp_base = me - me % ::dartree_emu::kWarpSize;
  rt.exchange[me] = predicate ? 1u : 0u;
  ::dartree_emu::warp_barrier(mask);
  unsigned bits = 0;
  for (unsigned lane = 0; lane < 32 && warp_base + lane < rt.fibers.size(); ++lane) {
    const ::dartree_emu::Fiber& f = rt.fibers[warp_base + lane];
    // an exited lane contributes nothing; a waiting lane has published its predicate
    if (f.state != ::dartree_emu::FiberState::kDone && rt.exchange[warp_base + lane]) bits |= 1u << lane;
  }
  ::dartree_emu::warp_barrier(mask);
  return bits & mask;
}
// The lanes of `mask` whose `value` equals this lane's (4- or 8-byte values, as on sm_70+).
template <typename T>
unsigned __match_any_sync(unsigned mask, T value) {
  static_assert((sizeof(T) == 4 || sizeof(T) == 8) && std::is_trivially_copyable<T>::value,
                "__match_any_sync takes 4- or 8-byte values");
  ::dartree_emu::Runtime& rt = ::dartree_emu::runtime();
  const unsigned me = ::dartree_emu::self().linear;
  const unsigned warp_base = me - me % ::dartree_emu::kWarpSize;
  uint64_t slot = 0;
  std::memcpy(&slot, &value, sizeof(T));
  rt.exchange[me] = slot;
  ::dartree_emu::warp_barrier(mask);
  unsigned bits = 0;
  for (unsigned lane = 0; lane < 32 && warp_base + lane < rt.fibers.size(); ++lane) {
    const ::dartree_emu::Fiber& f = rt.fibers[warp_base + lane];
    if (f.state != ::dartree_emu::FiberState::kDone && rt.exchange[warp_base + lane] == slot) bits |= 1u << lane;
  }
  ::dartree_emu::warp_barrier(mask);
  return bits & mask;
}
inline int __any_sync(unsigned mask, int predicate) { return __ballot_sync(mask, predicate) != 0; }
inline int __all_sync(unsigned mask, int predicate) { return __ballot_sync(mask, !predicate) == 0; }

inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }
inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll(static_cast<unsigned long long>(x)); }
template <typename T>
T __ldg(const T* p) { return *p; }

// Fibers never run concurrently, so a plain read-modify-write is atomic. The race detector
// exempts it.
namespace dartree_emu {
// The compiler barriers keep the flag's stores around the access (the tracing callbacks are
// inserted after optimization, which would otherwise drop the first store as dead).
struct AtomicScope {
  AtomicScope() {
    runtime().races.in_atomic = true;
    asm volatile("" ::: "memory");
  }
  ~AtomicScope() {
    asm volatile("" ::: "memory");
    runtime().races.in_atomic = false;
  }
};
}  // namespace dartree_emu
template <typename T> T atomicAdd(T* a, T v) { ::dartree_emu::AtomicScope s; T old = *a; *a = old + v; return old; }
template <typename T> T atomicSub(T* a, T v) { ::dartree_emu::AtomicScope s; T old = *a; *a = old - v; return old; }
template <typename T> T atomicMin(T* a, T v) { ::dartree_emu::AtomicScope s; T old = *a; *a = v < old ? v : old; return old; }
template <typename T> T atomicMax(T* a, T v) { ::dartree_emu::AtomicScope s; T old = *a; *a = v > old ? v : old; return old; }
template <typename T> T atomicExch(T* a, T v) { ::dartree_emu::AtomicScope s; T old = *a; *a = v; return old; }
template <typename T> T atomicOr(T* a, T v) { ::dartree_emu::AtomicScope s; T old = *a; *a = old | v; return old; }
template <typename T> T atomicAnd(T* a, T v) { ::dartree_emu::AtomicScope s; T old = *a; *a = old & v; return old; }
template <typename T> T atomicCAS(T* a, T compare, T v) {
  ::dartree_emu::AtomicScope s;
  T old = *a;
  if (old == compare) *a = v;
  return old;
}

#define DARTREE_SHARED_ARRAY(T, name, count)   \
  static char name##_shared_key_;            \
  T* name = ::dartree_emu::static_shared_array<T>(&name##_shared_key_, (count))
#define DARTREE_DYNAMIC_SHARED(T, name) \
  T* name = reinterpret_cast<T*>(::dartree_emu::runtime().dynamic_shared.data() + ::dartree_emu::kSharedGuardBytes)
// The kernel's name for counters and errors: the macro argument, or the launcher's name where that
// is a function-pointer alias called `kernel`.
#define DARTREE_LAUNCH(kernel, grid, block, shared_bytes, stream, ...)                                     \
  ((void)(stream), ::dartree_emu::launch((grid), (block), (shared_bytes),                                  \
                                         std::strcmp(#kernel, "kernel") == 0 ? __func__ : #kernel, \
                                         [=]() { kernel(__VA_ARGS__); }))
