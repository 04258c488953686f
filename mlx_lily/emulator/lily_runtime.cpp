// The emulator's runtime: runs the threads of a threadgroup as cooperatively
// scheduled fibers on one OS thread, releases barriers and SIMD-group
// collectives once every thread that must arrive has arrived, and turns
// deadlocks and out-of-bounds accesses into error messages.
//
// Compiled once into an object file and linked into every kernel library.
#include "lily_runtime.h"

#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#if defined(__x86_64__) && defined(__ELF__) && !defined(LILY_FORCE_UCONTEXT)
#define LILY_ASM_FIBERS 1
#else
#include <ucontext.h>
#endif

namespace lily {
namespace rt {
namespace {

// ---------------------------------------------------------------------------
// Fibers. Every fiber starts in fiber_main, which runs the thread g_cur
// points at. On x86-64 ELF platforms a hand-written switch saves only the
// callee-saved registers (a few nanoseconds); elsewhere ucontext is used.
// ---------------------------------------------------------------------------

void fiber_main();

#if LILY_ASM_FIBERS

extern "C" void lily_fiber_switch(void** save_sp, void* next_sp);
extern "C" void lily_fiber_trampoline();

asm(R"(
    .text
    .globl lily_fiber_switch
    .hidden lily_fiber_switch
    .type lily_fiber_switch, @function
lily_fiber_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size lily_fiber_switch, .-lily_fiber_switch

    .globl lily_fiber_trampoline
    .hidden lily_fiber_trampoline
    .type lily_fiber_trampoline, @function
lily_fiber_trampoline:
    callq *%r13
    ud2
    .size lily_fiber_trampoline, .-lily_fiber_trampoline
)");

struct Context {
  void* sp = nullptr;
};

void context_init(Context& c, char* stack, size_t size) {
  // The frame lily_fiber_switch pops: r15 r14 r13 r12 rbx rbp, then the
  // return address. After `ret` the stack is 16-byte aligned for the
  // trampoline's call of r13.
  uintptr_t top = (reinterpret_cast<uintptr_t>(stack) + size) & ~uintptr_t(15);
  void** sp = reinterpret_cast<void**>(top - 72);
  for (int i = 0; i < 6; ++i) sp[i] = nullptr;
  sp[2] = reinterpret_cast<void*>(&fiber_main);              // r13
  sp[6] = reinterpret_cast<void*>(&lily_fiber_trampoline);  // return address
  c.sp = sp;
}

inline void context_switch(Context& from, Context& to) {
  lily_fiber_switch(&from.sp, to.sp);
}

#else  // portable fallback

struct Context {
  ucontext_t uc;
};

void context_init(Context& c, char* stack, size_t size) {
  getcontext(&c.uc);
  c.uc.uc_stack.ss_sp = stack;
  c.uc.uc_stack.ss_size = size;
  c.uc.uc_link = nullptr;
  makecontext(&c.uc, fiber_main, 0);
}

inline void context_switch(Context& from, Context& to) {
  swapcontext(&from.uc, &to.uc);
}

#endif

// ---------------------------------------------------------------------------
// Scheduler state
// ---------------------------------------------------------------------------

enum class State : uint8_t {
  kReady,
  kRunning,
  kBarrier,         // threadgroup_barrier
  kSimdBarrier,     // simdgroup_barrier
  kCollective,      // simd_sum, simd_shuffle, simdgroup_load, ...
  kDone,            // returned from the kernel
};

struct Thread {
  Context ctx;
  ThreadIds ids;
  State state = State::kReady;
  const char* what = nullptr;  // name of the barrier/collective waited at
  int line = 0;
  const char* file = nullptr;
  CollectiveFn fn = nullptr;
  uint32_t yield_count = 0;
  alignas(16) unsigned char in[kLaneSlotBytes];
  alignas(16) unsigned char out[kLaneSlotBytes];
};

struct TgVar {
  const char* name;
  size_t offset;
  size_t size;
};

constexpr size_t kStackSize = 256 * 1024;

struct Run {
  const Launch* launch = nullptr;
  Context scheduler;
  std::vector<Thread> threads;
  int nthreads = 0;
  alignas(64) unsigned char arena[kThreadgroupMemoryLimit];
  size_t arena_used = 0;
  std::vector<long> slot_offset;  // per declaration site, -1: not yet
  std::vector<TgVar> tg_vars;
  int status = kOk;
  std::string error;
  std::chrono::steady_clock::time_point deadline;
  bool has_deadline = false;
};

Run* g_run = nullptr;
Thread* g_cur = nullptr;
std::mutex g_launch_mutex;  // one launch per library at a time

// ---------------------------------------------------------------------------
// Formatting helpers
// ---------------------------------------------------------------------------

std::string format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
std::string format(const char* fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  return buf;
}

std::string u3(const U3& v) { return format("(%u,%u,%u)", v.x, v.y, v.z); }

// "source line 12" for the kernel body, "header line 3" for the header.
std::string where(int line, const char* file) {
  if (!file || line <= 0) return "an unknown line";
  return format("%s line %d", file, line);
}

std::string describe_thread(const Thread& t) {
  return format("thread %s of threadgroup %s (thread_position_in_grid %s)",
                u3(t.ids.thread_position_in_threadgroup).c_str(),
                u3(t.ids.threadgroup_position_in_grid).c_str(),
                u3(t.ids.thread_position_in_grid).c_str());
}

[[noreturn]] void abandon_fiber() {
  // Back to the scheduler for good; the fiber's stack is simply reused.
  g_cur->state = State::kDone;
  context_switch(g_cur->ctx, g_run->scheduler);
  std::abort();  // never resumed
}

void set_error(int status, std::string msg) {
  if (g_run->status == kOk) {
    g_run->status = status;
    g_run->error = std::move(msg);
  }
}

void check_timeout() {
  if (g_run->has_deadline &&
      std::chrono::steady_clock::now() > g_run->deadline) {
    set_error(kTimeout,
              format("timed out after %.1f s (MLX_LILY_EMULATOR_TIMEOUT); "
                     "a thread may be spinning on a condition that no other "
                     "thread of its threadgroup will make true",
                     g_run->launch->timeout_s));
  }
}

// Which kernel argument or threadgroup variable does [lo, hi) belong to?
std::string describe_oob(const void* lo, const void* hi, const void* addr,
                         size_t elem_size, int64_t index, bool is_read) {
  const char* plo = static_cast<const char*>(lo);
  const char* paddr = static_cast<const char*>(addr);
  const Launch& L = *g_run->launch;
  const char* kind = is_read ? "read" : "access";
  for (int i = 0; i < L.nbuffers; ++i) {
    const Buffer& b = L.buffers[i];
    if (plo == b.lo) {  // pointers made from a buffer keep its lo
      long long elem = (long long)((paddr - b.data) / (long long)elem_size);
      long long count = (long long)((b.hi - b.lo) / (long long)elem_size);
      std::string extent =
          b.lo == b.data
              ? format("valid elements 0..%lld", count - 1)
              : format("valid byte range %lld..%lld",
                       (long long)(b.lo - b.data), (long long)(b.hi - b.data));
      return format(
          "out-of-bounds %s of buffer '%s' (%s, %lld bytes): index %lld "
          "through the pointer is element %lld of '%s' (%s)",
          kind, b.name, b.type_name, (long long)(b.hi - b.lo),
          (long long)index, elem, b.name, extent.c_str());
    }
  }
  for (const TgVar& v : g_run->tg_vars) {
    const char* base = reinterpret_cast<const char*>(g_run->arena) + v.offset;
    if (plo >= base && plo < base + v.size) {  // rows of 2-D arrays too
      long long elem = (long long)((paddr - base) / (long long)elem_size);
      return format(
          "out-of-bounds %s of threadgroup variable '%s' (%zu bytes): index "
          "%lld through the pointer is element %lld of '%s' (valid 0..%lld)",
          kind, v.name, v.size, (long long)index, elem, v.name,
          (long long)(v.size / elem_size) - 1);
    }
  }
  return format("out-of-bounds %s at index %lld of a pointer to %lld bytes",
                kind, (long long)index,
                (long long)(static_cast<const char*>(hi) - plo));
}

// ---------------------------------------------------------------------------
// Faults. While a launch runs, a crash inside kernel code (integer division
// by zero, a wild unchecked pointer, a stack overflow) ends the launch with
// an error instead of the process: the handler, running on its own stack,
// abandons the faulting fiber and switches to the scheduler. Faults
// anywhere else go to the handler that was installed before.
// ---------------------------------------------------------------------------

constexpr int kFaultSignals[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL};
constexpr int kNumFaultSignals = sizeof(kFaultSignals) / sizeof(int);
struct sigaction g_old_actions[kNumFaultSignals];
stack_t g_old_altstack;
alignas(64) char g_altstack[64 * 1024];
volatile bool g_in_fiber = false;  // a kernel fiber is running ...
pthread_t g_launch_thread;          // ... on this OS thread

const char* fault_name(int sig) {
  switch (sig) {
    case SIGFPE: return "an arithmetic fault (integer division by zero?)";
    case SIGILL: return "an illegal instruction";
    default: return "an invalid memory access (an unchecked pointer such as "
                    "&x[i] out of bounds, or a stack overflow)";
  }
}

void fault_handler(int sig, siginfo_t* info, void*) {
  if (!g_in_fiber || !g_run || !g_cur ||
      !pthread_equal(pthread_self(), g_launch_thread)) {
    for (int i = 0; i < kNumFaultSignals; ++i) {
      if (kFaultSignals[i] == sig) sigaction(sig, &g_old_actions[i], nullptr);
    }
    return;  // the fault recurs under the previous handler
  }
  g_in_fiber = false;
  set_error(kRuntimeError,
            format("%s crashed with %s (address %p)",
                   describe_thread(*g_cur).c_str(), fault_name(sig),
                   info ? info->si_addr : nullptr));
  abandon_fiber();
}

void install_fault_handlers() {
  g_launch_thread = pthread_self();
  stack_t ss;
  ss.ss_sp = g_altstack;
  ss.ss_size = sizeof(g_altstack);
  ss.ss_flags = 0;
  sigaltstack(&ss, &g_old_altstack);
  struct sigaction sa;
  memset(&sa, 0, sizeof(sa));
  sa.sa_sigaction = fault_handler;
  // SA_NODEFER: the handler never returns (no sigreturn), so it must not
  // leave the signal blocked.
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
  sigemptyset(&sa.sa_mask);
  for (int i = 0; i < kNumFaultSignals; ++i) {
    sigaction(kFaultSignals[i], &sa, &g_old_actions[i]);
  }
}

void remove_fault_handlers() {
  for (int i = 0; i < kNumFaultSignals; ++i) {
    sigaction(kFaultSignals[i], &g_old_actions[i], nullptr);
  }
  sigaltstack(&g_old_altstack, nullptr);
}

// ---------------------------------------------------------------------------
// Fiber body
// ---------------------------------------------------------------------------

void fiber_main() {
  Thread* self = g_cur;
  g_run->launch->thread_main(*g_run->launch, self->ids);
  self->state = State::kDone;
  context_switch(self->ctx, g_run->scheduler);
  std::abort();  // a finished fiber is never resumed
}

void block(State s, const char* what, int line, const char* file,
           CollectiveFn fn) {
  Thread* t = g_cur;
  t->state = s;
  t->what = what;
  t->line = line;
  t->file = file;
  t->fn = fn;
  context_switch(t->ctx, g_run->scheduler);
}

// ---------------------------------------------------------------------------
// Release rules
// ---------------------------------------------------------------------------

bool is_simd_wait(State s) {
  return s == State::kSimdBarrier || s == State::kCollective;
}

bool same_wait(const Thread& a, const Thread& b) {
  return a.state == b.state && a.fn == b.fn && a.line == b.line &&
         (a.file == b.file || (a.file && b.file && !strcmp(a.file, b.file)));
}

// A SIMD-group proceeds when all of its lanes that have not exited wait at
// the same collective (or all of its lanes at the same simdgroup_barrier).
bool try_release_simdgroup(int first, int end) {
  Thread* lead = nullptr;
  uint32_t active = 0;
  int alive = 0;
  for (int i = first; i < end; ++i) {
    Thread& t = g_run->threads[i];
    if (t.state == State::kDone) continue;
    if (!is_simd_wait(t.state)) return false;
    if (lead && !same_wait(*lead, t)) return false;
    if (!lead) lead = &t;
    active |= 1u << (i - first);
    ++alive;
  }
  if (!lead) return false;
  if (lead->state == State::kSimdBarrier && alive != end - first) {
    return false;  // exited lanes never reach the barrier: deadlock
  }
  if (lead->state == State::kCollective) {
    CollArgs args;
    OpFault fault{};
    fault.lane = -1;
    args.nlanes = end - first;
    args.active = active;
    args.fault = &fault;
    for (int l = 0; l < kSimdWidth; ++l) {
      bool on = l < end - first && ((active >> l) & 1);
      args.in[l] = on ? g_run->threads[first + l].in : nullptr;
      args.out[l] = on ? g_run->threads[first + l].out : nullptr;
    }
    if (!lead->fn(args)) {
      Thread& t = g_run->threads[first + (fault.lane >= 0 ? fault.lane : 0)];
      set_error(kOutOfBounds,
                format("%s in %s by %s at %s",
                       describe_oob(fault.lo, fault.hi, fault.addr,
                                    fault.elem_size, fault.index,
                                    fault.is_read).c_str(),
                       t.what, describe_thread(t).c_str(),
                       where(t.line, t.file).c_str()));
      return false;
    }
  }
  for (int i = first; i < end; ++i) {
    Thread& t = g_run->threads[i];
    if (t.state != State::kDone) t.state = State::kReady;
  }
  return true;
}

// A threadgroup barrier proceeds when every thread of the threadgroup waits
// at it. A thread that has returned can never arrive.
bool try_release_barrier() {
  const Thread& lead = g_run->threads[0];
  if (lead.state != State::kBarrier) return false;
  for (int i = 1; i < g_run->nthreads; ++i) {
    if (!same_wait(lead, g_run->threads[i])) return false;
  }
  for (int i = 0; i < g_run->nthreads; ++i) {
    g_run->threads[i].state = State::kReady;
  }
  return true;
}

// Lists the threads of each wait point, compactly.
std::string deadlock_report() {
  struct Group {
    const Thread* lead;
    std::vector<const Thread*> members;
  };
  std::vector<Group> groups;
  int done = 0;
  for (int i = 0; i < g_run->nthreads; ++i) {
    const Thread& t = g_run->threads[i];
    if (t.state == State::kDone) ++done;
    bool placed = false;
    for (Group& g : groups) {
      if (g.lead->state == t.state &&
          (t.state == State::kDone || same_wait(*g.lead, t))) {
        g.members.push_back(&t);
        placed = true;
        break;
      }
    }
    if (!placed) groups.push_back({&t, {&t}});
  }
  const ThreadIds& ids = g_run->threads[0].ids;
  std::string headline;
  int waiting_groups = (int)groups.size() - (done ? 1 : 0);
  const Group* first_wait = nullptr;
  for (const Group& g : groups) {
    if (g.lead->state != State::kDone) {
      first_wait = &g;
      break;
    }
  }
  if (waiting_groups == 1 && done) {
    headline = format(
        "%s at %s is never reached by %d thread(s) that already returned",
        first_wait->lead->what,
        where(first_wait->lead->line, first_wait->lead->file).c_str(), done);
  } else if (waiting_groups > 1) {
    headline =
        "threads wait at different barriers/collectives (divergent control "
        "flow)";
  } else {
    headline = "threads wait at a barrier/collective that cannot complete";
  }
  std::string msg = format("deadlock in threadgroup %s: %s\n",
                           u3(ids.threadgroup_position_in_grid).c_str(),
                           headline.c_str());
  for (const Group& g : groups) {
    const Thread& t = *g.lead;
    if (t.state == State::kDone) {
      msg += format("  %zu thread(s) returned from the kernel:",
                    g.members.size());
    } else {
      msg += format("  %zu thread(s) wait at %s (%s):", g.members.size(),
                    t.what, where(t.line, t.file).c_str());
    }
    size_t shown = 0;
    for (const Thread* m : g.members) {
      if (shown == 8) {
        msg += format(" ... and %zu more", g.members.size() - shown);
        break;
      }
      msg += " " + u3(m->ids.thread_position_in_threadgroup);
      if (is_simd_wait(m->state)) {
        msg += format("[simdgroup %u lane %u]",
                      m->ids.simdgroup_index_in_threadgroup,
                      m->ids.thread_index_in_simdgroup);
      }
      ++shown;
    }
    msg += "\n";
  }
  msg += "  (thread positions are thread_position_in_threadgroup)";
  return msg;
}

// ---------------------------------------------------------------------------
// Running a threadgroup
// ---------------------------------------------------------------------------

void resume(Thread& t) {
  g_cur = &t;
  t.state = State::kRunning;
  g_in_fiber = true;
  context_switch(g_run->scheduler, t.ctx);
  g_in_fiber = false;
}

void run_threadgroup() {
  Run& r = *g_run;
  const int simd_groups = (r.nthreads + kSimdWidth - 1) / kSimdWidth;
  for (;;) {
    bool ran = false;
    for (int i = 0; i < r.nthreads; ++i) {
      if (r.threads[i].state == State::kReady) {
        resume(r.threads[i]);
        ran = true;
        if (r.status != kOk) return;
      }
    }
    if (ran) {
      check_timeout();
      if (r.status != kOk) return;
      continue;
    }
    bool all_done = true;
    for (int i = 0; i < r.nthreads; ++i) {
      all_done = all_done && r.threads[i].state == State::kDone;
    }
    if (all_done) return;
    bool released = false;
    for (int s = 0; s < simd_groups; ++s) {
      int first = s * kSimdWidth;
      int end = first + kSimdWidth < r.nthreads ? first + kSimdWidth
                                                 : r.nthreads;
      released = try_release_simdgroup(first, end) || released;
      if (r.status != kOk) return;
    }
    if (!released) released = try_release_barrier();
    if (!released) {
      set_error(kDeadlock, deadlock_report());
      return;
    }
  }
}

uint32_t ceil_div(uint32_t a, uint32_t b) { return (a + b - 1) / b; }

ThreadIds make_ids(const Launch& L, const U3& tg_pos, const U3& tg_size,
                   uint32_t lid) {
  const U3 dispatch = {L.threadgroup[0], L.threadgroup[1], L.threadgroup[2]};
  ThreadIds t;
  U3 local = {lid % tg_size.x, (lid / tg_size.x) % tg_size.y,
              lid / (tg_size.x * tg_size.y)};
  uint32_t n = tg_size.x * tg_size.y * tg_size.z;
  uint32_t dispatch_n = dispatch.x * dispatch.y * dispatch.z;
  t.thread_position_in_threadgroup = local;
  t.threadgroup_position_in_grid = tg_pos;
  t.thread_position_in_grid = {tg_pos.x * dispatch.x + local.x,
                               tg_pos.y * dispatch.y + local.y,
                               tg_pos.z * dispatch.z + local.z};
  t.threads_per_threadgroup = tg_size;
  t.dispatch_threads_per_threadgroup = dispatch;
  t.threadgroups_per_grid = {ceil_div(L.grid[0], dispatch.x),
                             ceil_div(L.grid[1], dispatch.y),
                             ceil_div(L.grid[2], dispatch.z)};
  t.threads_per_grid = {L.grid[0], L.grid[1], L.grid[2]};
  t.thread_index_in_threadgroup = lid;
  t.thread_index_in_simdgroup = lid % kSimdWidth;
  t.simdgroup_index_in_threadgroup = lid / kSimdWidth;
  t.simdgroups_per_threadgroup = ceil_div(n, kSimdWidth);
  t.dispatch_simdgroups_per_threadgroup = ceil_div(dispatch_n, kSimdWidth);
  t.thread_index_in_quadgroup = lid % 4;
  t.quadgroup_index_in_threadgroup = lid / 4;
  t.quadgroups_per_threadgroup = ceil_div(n, 4);
  t.dispatch_quadgroups_per_threadgroup = ceil_div(dispatch_n, 4);
  return t;
}

// Fiber stacks are kept from launch to launch (grown when a launch needs
// more), so a launch does not pay for mapping and faulting them in again.
// Every kernel library links its own runtime, hence its own pool, and each
// stack's guard page splits the mapping: a process that loads hundreds of
// kernels would run out of memory mappings (vm.max_map_count) if every pool
// stayed large, so pools above kKeptStacks are given back after the launch.
constexpr size_t kKeptStacks = 64;
struct StackPool {
  char* base = nullptr;
  size_t count = 0;
  size_t page = 0;
};
StackPool g_stacks;

bool reserve_stacks(size_t n) {
  if (g_stacks.count >= n) return true;
  if (g_stacks.base) munmap(g_stacks.base, kStackSize * g_stacks.count);
  g_stacks = StackPool{};
  g_stacks.page = (size_t)sysconf(_SC_PAGESIZE);
  void* m = mmap(nullptr, kStackSize * n, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) return false;
  g_stacks.base = static_cast<char*>(m);
  g_stacks.count = n;
  // A guard page at the bottom of each stack.
  for (size_t i = 0; i < n; ++i) {
    mprotect(g_stacks.base + kStackSize * i, g_stacks.page, PROT_NONE);
  }
  return true;
}

void trim_stacks() {
  if (g_stacks.count <= kKeptStacks) return;
  munmap(g_stacks.base, kStackSize * g_stacks.count);
  g_stacks = StackPool{};
}

int run_grid(Run& r, const Launch& L) {
  const U3 dispatch = {L.threadgroup[0], L.threadgroup[1], L.threadgroup[2]};
  const U3 groups = {ceil_div(L.grid[0], dispatch.x),
                     ceil_div(L.grid[1], dispatch.y),
                     ceil_div(L.grid[2], dispatch.z)};
  const int max_threads = (int)(dispatch.x * dispatch.y * dispatch.z);
  r.threads.resize(max_threads);
  if (!reserve_stacks((size_t)max_threads)) {
    set_error(kRuntimeError, "could not allocate fiber stacks");
    return r.status;
  }
  for (uint32_t gz = 0; gz < groups.z; ++gz) {
    for (uint32_t gy = 0; gy < groups.y; ++gy) {
      for (uint32_t gx = 0; gx < groups.x; ++gx) {
        const U3 pos = {gx, gy, gz};
        // Edge threadgroups are clipped to the grid (dispatchThreads).
        const U3 size = {
            L.grid[0] - gx * dispatch.x < dispatch.x ? L.grid[0] - gx * dispatch.x
                                                     : dispatch.x,
            L.grid[1] - gy * dispatch.y < dispatch.y ? L.grid[1] - gy * dispatch.y
                                                     : dispatch.y,
            L.grid[2] - gz * dispatch.z < dispatch.z ? L.grid[2] - gz * dispatch.z
                                                     : dispatch.z};
        r.nthreads = (int)(size.x * size.y * size.z);
        for (int i = 0; i < r.nthreads; ++i) {
          Thread& t = r.threads[i];
          t.ids = make_ids(L, pos, size, (uint32_t)i);
          t.state = State::kReady;
          t.yield_count = 0;
          context_init(t.ctx, g_stacks.base + kStackSize * (size_t)i + g_stacks.page,
                       kStackSize - g_stacks.page);
        }
        r.arena_used = 0;
        r.tg_vars.clear();
        for (long& s : r.slot_offset) s = -1;
        run_threadgroup();
        if (r.status != kOk) return r.status;
      }
    }
  }
  return kOk;
}

}  // namespace

// ---------------------------------------------------------------------------
// Public entry points
// ---------------------------------------------------------------------------

int run(const Launch& L, char* err, int errlen) {
  std::lock_guard<std::mutex> lock(g_launch_mutex);
  Run* r = new Run();
  r->launch = &L;
  if (L.timeout_s > 0) {
    r->has_deadline = true;
    r->deadline = std::chrono::steady_clock::now() +
                  std::chrono::microseconds((long long)(L.timeout_s * 1e6));
  }
  g_run = r;
  int status = kOk;
  if (L.grid[0] && L.grid[1] && L.grid[2]) {
    install_fault_handlers();
    status = run_grid(*r, L);
    remove_fault_handlers();
    trim_stacks();
  }
  if (status != kOk && err && errlen > 0) {
    snprintf(err, (size_t)errlen, "%s", r->error.c_str());
  }
  g_run = nullptr;
  g_cur = nullptr;
  delete r;
  return status;
}

void fail_oob(const void* lo, const void* hi, const void* addr,
              size_t elem_size, int64_t index, bool is_read, int line,
              const char* file) {
  std::string what = describe_oob(lo, hi, addr, elem_size, index, is_read);
  set_error(kOutOfBounds,
            format("%s by %s at %s", what.c_str(),
                   describe_thread(*g_cur).c_str(), where(line, file).c_str()));
  abandon_fiber();
}

void* tg_var(int slot, size_t size, size_t align, const char* name, int line,
             const char* file) {
  Run& r = *g_run;
  if ((size_t)slot >= r.slot_offset.size()) r.slot_offset.resize(slot + 1, -1);
  if (r.slot_offset[slot] < 0) {
    if (align < 16) align = 16;
    size_t off = (r.arena_used + align - 1) & ~(align - 1);
    if (off + size > kThreadgroupMemoryLimit) {
      set_error(kRuntimeError,
                format("threadgroup variable '%s' (%s) needs %zu bytes, "
                       "exceeding Metal's %zu-byte threadgroup memory limit "
                       "(%zu bytes already in use)",
                       name, where(line, file).c_str(), size,
                       kThreadgroupMemoryLimit, r.arena_used));
      abandon_fiber();
    }
    // Poison: NaN for every float type, -1 for integers.
    memset(r.arena + off, 0xFF, size);
    r.arena_used = off + size;
    r.slot_offset[slot] = (long)off;
    r.tg_vars.push_back({name, off, size});
  }
  return r.arena + r.slot_offset[slot];
}

void barrier(bool simd, int line, const char* file) {
  block(simd ? State::kSimdBarrier : State::kBarrier,
        simd ? "simdgroup_barrier" : "threadgroup_barrier", line, file,
        nullptr);
}

unsigned char* lane_in() { return g_cur->in; }
unsigned char* lane_out() { return g_cur->out; }
uint32_t lane_id() { return g_cur->ids.thread_index_in_simdgroup; }

void collective(CollectiveFn fn, const char* what, int line,
                const char* file) {
  block(State::kCollective, what, line, file, fn);
}

uint32_t g_loop_countdown = kLoopCheckInterval;

void loop_check(int line, const char* file) {
  g_loop_countdown = kLoopCheckInterval;
  check_timeout();
  if (g_run->status == kTimeout) {
    g_run->error += format("\n  %s was running the loop at %s",
                           describe_thread(*g_cur).c_str(),
                           where(line, file).c_str());
    abandon_fiber();
  }
  Thread* t = g_cur;
  t->state = State::kReady;
  context_switch(t->ctx, g_run->scheduler);
}

void yield() {
  Thread* t = g_cur;
  if (++t->yield_count % 64 != 0) return;
  check_timeout();
  if (g_run->status != kOk) {
    g_run->error += "\n  " + describe_thread(*t) + " was in an atomic operation";
    abandon_fiber();
  }
  t->state = State::kReady;
  context_switch(t->ctx, g_run->scheduler);
}

}  // namespace rt
}  // namespace lily
