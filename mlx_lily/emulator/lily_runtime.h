// The interface between a compiled kernel and the emulator's runtime
// (lily_runtime.cpp): the launch description filled in by Python, the
// per-thread builtin values, and the calls kernel code makes into the
// scheduler (barriers, SIMD-group rendezvous, threadgroup memory, errors).
//
// Kept free of Metal names so that both the prelude and the runtime can
// include it.
#pragma once

#include <cstddef>
#include <cstdint>

namespace lily {
namespace rt {

constexpr int kSimdWidth = 32;
constexpr int kMaxThreadsPerThreadgroup = 1024;
constexpr size_t kThreadgroupMemoryLimit = 32768;  // Metal's 32 KiB
constexpr int kLaneSlotBytes = 128;                 // per-lane collective payload

struct U3 {
  uint32_t x, y, z;
};

// The values of every Metal kernel attribute for one thread.
struct ThreadIds {
  U3 thread_position_in_grid;
  U3 thread_position_in_threadgroup;
  U3 threadgroup_position_in_grid;
  U3 threads_per_threadgroup;           // this (possibly clipped) threadgroup
  U3 dispatch_threads_per_threadgroup;  // as requested at dispatch
  U3 threadgroups_per_grid;
  U3 threads_per_grid;
  uint32_t thread_index_in_threadgroup;
  uint32_t thread_index_in_simdgroup;
  uint32_t simdgroup_index_in_threadgroup;
  uint32_t simdgroups_per_threadgroup;
  uint32_t dispatch_simdgroups_per_threadgroup;
  uint32_t thread_index_in_quadgroup;
  uint32_t quadgroup_index_in_threadgroup;
  uint32_t quadgroups_per_threadgroup;
  uint32_t dispatch_quadgroups_per_threadgroup;
};

// One kernel argument as seen by the bounds checker. `data` is what the
// kernel receives; [lo, hi) is the memory it may touch through it.
// Layout mirrored by ctypes in runner.py.
struct Buffer {
  const char* name;
  const char* type_name;
  char* data;
  char* lo;
  char* hi;
  int64_t elem_size;
};

struct Launch;
using ThreadMain = void (*)(const Launch&, const ThreadIds&);

// Layout mirrored by ctypes in runner.py.
struct Launch {
  const char* kernel_name;
  uint32_t grid[3];
  uint32_t threadgroup[3];
  int32_t nbuffers;
  const Buffer* buffers;
  double timeout_s;
  ThreadMain thread_main;  // filled in by the generated entry point
};

enum Status : int {
  kOk = 0,
  kDeadlock = 1,
  kOutOfBounds = 2,
  kRuntimeError = 3,
  kTimeout = 4,
};

// Runs every threadgroup of the grid. Returns a Status; on failure `err`
// holds a message (NUL-terminated, truncated to errlen).
int run(const Launch& launch, char* err, int errlen);

// ---- calls made from kernel code (always on a thread's fiber) ----

// An access outside [lo, hi). Never returns: the launch is abandoned.
[[noreturn]] void fail_oob(const void* lo, const void* hi, const void* addr,
                           size_t elem_size, int64_t index, bool is_read,
                           int line, const char* file);

// Shared storage of the threadgroup variable declared at `slot`: the same
// bytes for every thread of the threadgroup, fresh and poisoned (0xFF) for
// every threadgroup.
void* tg_var(int slot, size_t size, size_t align, const char* name, int line,
             const char* file);

// threadgroup_barrier (simd == false) or simdgroup_barrier (simd == true).
void barrier(bool simd, int line, const char* file);

// A SIMD-group collective. The calling lane has written its payload to
// lane_in(); `fn` runs once every active lane of the SIMD-group has arrived
// at the same call, reading all inputs and writing every active lane's
// lane_out().
struct OpFault {
  int lane;  // -1: no fault
  const void* lo;
  const void* hi;
  const void* addr;
  size_t elem_size;
  int64_t index;
  bool is_read;
};
struct CollArgs {
  int nlanes;       // lanes that exist in this SIMD-group (<= 32)
  uint32_t active;  // bit l: lane l has not exited
  const unsigned char* in[kSimdWidth];
  unsigned char* out[kSimdWidth];
  OpFault* fault;   // set fault->lane and return false on an error
};
using CollectiveFn = bool (*)(const CollArgs&);

unsigned char* lane_in();
unsigned char* lane_out();
void collective(CollectiveFn fn, const char* what, int line, const char* file);
uint32_t lane_id();

// Lets other threads of the threadgroup run (used by atomics so that
// spin-waits make progress). Also enforces the launch timeout.
void yield();

// Every loop condition in kernel code is prefixed with loop_guard(): every
// kLoopCheckInterval iterations the thread yields (so spin-waits on plain
// memory progress) and the launch timeout is checked, so that an endless
// loop raises an error instead of hanging.
constexpr uint32_t kLoopCheckInterval = 1u << 16;
extern uint32_t g_loop_countdown __attribute__((visibility("hidden")));
void loop_check(int line, const char* file);
inline __attribute__((always_inline)) bool loop_guard(
    int line = __builtin_LINE(), const char* file = __builtin_FILE()) {
  if (__builtin_expect(--g_loop_countdown == 0, 0)) loop_check(line, file);
  return true;
}

}  // namespace rt
}  // namespace lily
