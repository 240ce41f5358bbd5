// The process's one pool of threads (cpu_pool.py says why), a module of its own without prelude.h.

#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <thread>

namespace {

using Task = void (*)(const void* context, int64_t task);
using Clock = std::chrono::steady_clock;
static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t), "a futex is a plain 32-bit word");

void futex_wait(std::atomic<uint32_t>& word, uint32_t expected) {  // returns at once unless word == expected
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT_PRIVATE, expected, nullptr, nullptr, 0);
}

void futex_wake(std::atomic<uint32_t>& word, int count) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE_PRIVATE, count, nullptr, nullptr, 0);
}

// How long a helper spins for the next call after its last task: a decode step's calls come tens of
// microseconds apart, and a wake from the futex costs ~45 us. SmolLM2 bf16 on two cores, ms a step
// at 4K (and the process's CPU ms): spin 0 us 8.3 (12.4), 30 us 6.6 (13.0), 60 us 6.5 (12.6),
// 200 us 7.0 (13.9); longer spins only take cores from other work (TRIFORCE_SPIN_US overrides)
constexpr int64_t SPIN_US = 50;

Clock::duration spin_time() {
  const char* text = std::getenv("TRIFORCE_SPIN_US");
  return std::chrono::microseconds(text ? std::atoll(text) : SPIN_US);
}

// One call's tasks [0, tasks), taken in order by the caller and up to `helpers` pool threads
struct Job {
  Task task;
  const void* context;
  int64_t tasks, helpers;
  int64_t* ran_by;  // for tests: who took each task (0 the caller, i the i-th helper), or null
  std::atomic<int64_t> next{0};
  std::atomic<bool> failed{false};
  std::exception_ptr error;  // the first task's exception, thrown again by the caller

  void take_tasks(int64_t who) {
    for (int64_t t = next.fetch_add(1); t < tasks; t = next.fetch_add(1)) {
      if (ran_by) ran_by[t] = who;
      try {
        task(context, t);
      } catch (...) {
        if (!failed.exchange(true)) error = std::current_exception();
        next.store(tasks);  // the others stop taking tasks
      }
    }
  }
};

// Memory order: every operation on the pool's atomics is sequentially consistent. A helper counts
// itself in `busy` before it reads `job`, and the caller empties `job` before it waits for `busy`
// to reach 0, so a helper either is counted while it works or finds no job: the Job on the caller's
// stack is never read after the caller returns.
class Pool {
 public:
  void run(int64_t tasks, int64_t threads, Task task, const void* context, int64_t* ran_by = nullptr) {
    Job job{task, context, tasks, threads - 1, ran_by};
    // one call at a time: a second caller (another Python thread, a task's own call) runs alone
    bool alone = threads <= 1 || tasks <= 1 || in_use_.exchange(true);
    if (!alone) {
      start_helpers(job.helpers);
      job_.store(&job);
      epoch_.fetch_add(1);
      if (sleeping_.load() > 0) futex_wake(epoch_, INT_MAX);
    }
    job.take_tasks(0);
    if (!alone) {
      job_.store(nullptr);
      wait_for_helpers();
      in_use_.store(false);
    }
    if (job.error) std::rethrow_exception(job.error);
  }

  int64_t helpers() const { return started_.load(); }

 private:
  std::atomic<Job*> job_{nullptr};
  std::atomic<uint32_t> epoch_{0};      // a new job each time it moves; sleeping helpers wait on it
  std::atomic<uint32_t> busy_{0};       // helpers inside a job
  std::atomic<uint32_t> sleeping_{0};   // helpers asleep on epoch_
  std::atomic<uint32_t> caller_waits_{0};  // the caller asleep on busy_
  std::atomic<bool> in_use_{false};
  std::atomic<int64_t> started_{0};
  std::mutex starting_;
  Clock::duration spin_ = spin_time();

  void start_helpers(int64_t wanted) {
    if (started_.load() >= wanted) return;
    std::lock_guard<std::mutex> lock(starting_);
    for (int64_t i = started_.load(); i < wanted; ++i) {
      std::thread(&Pool::serve, this, i + 1, epoch_.load()).detach();  // it sees the job about to open
      started_.store(i + 1);
    }
  }

  // a helper's life: wait for a new job, take its tasks while any are left, again
  void serve(int64_t who, uint32_t seen) {
    bool spin = true;
    for (;;) {
      seen = next_epoch(seen, spin);
      busy_.fetch_add(1);
      Job* job = job_.load();
      spin = job == nullptr || who <= job->helpers;  // a thread the call did not want sleeps at once
      if (job && who <= job->helpers) job->take_tasks(who);
      if (busy_.fetch_sub(1) == 1 && caller_waits_.load()) futex_wake(busy_, 1);
    }
  }

  uint32_t next_epoch(uint32_t seen, bool spin) {
    Clock::time_point until = Clock::now() + (spin ? spin_ : Clock::duration::zero());
    for (int64_t i = 1;; ++i) {
      uint32_t now = epoch_.load();
      if (now != seen) return now;
      if (i % 64 != 0 || Clock::now() < until) {
        _mm_pause();
        continue;
      }
      sleeping_.fetch_add(1);
      futex_wait(epoch_, seen);
      sleeping_.fetch_sub(1);
    }
  }

  // the tasks helpers have under way: usually microseconds, but a helper the system preempted may
  // hold one for a time slice, so the caller then sleeps rather than spin against it
  void wait_for_helpers() {
    for (int64_t i = 0; busy_.load() != 0; ++i) {
      if (i < 4096) {
        _mm_pause();
        continue;
      }
      caller_waits_.store(1);
      uint32_t busy = busy_.load();
      if (busy != 0) futex_wait(busy_, busy);
      caller_waits_.store(0);
    }
  }
};

// A forked child has none of its parent's threads: it starts a pool of its own at its first call
std::atomic<Pool*> the_pool{nullptr};

Pool& pool() {
  static std::once_flag registered;
  std::call_once(registered, [] { pthread_atfork(nullptr, nullptr, [] { the_pool.store(nullptr); }); });
  Pool* p = the_pool.load();
  if (p == nullptr) {
    Pool* made = new Pool();  // never deleted: its helpers live as long as the process
    p = the_pool.compare_exchange_strong(p, made) ? made : (delete made, p);
  }
  return *p;
}

// The kernels' threads: torch's (--threads) unless set_threads chose another count (0: torch's again)
std::atomic<int64_t> chosen_threads{0};

int64_t threads() {
  int64_t chosen = chosen_threads.load(std::memory_order_relaxed);
  return chosen > 0 ? chosen : at::get_num_threads();
}

void set_threads(int64_t count) { chosen_threads.store(count); }

void pool_run(int64_t tasks, Task task, const void* context) {
  pool().run(tasks, std::min(threads(), tasks), task, context);
}

int64_t address() { return reinterpret_cast<int64_t>(&pool_run); }
int64_t helpers() { return pool().helpers(); }

// For tests: `tasks` tasks of about task_us each over `threads` threads, task `failing` (if any)
// throwing; which thread ran each (0 the caller, i the pool's i-th helper, -1 none)
struct Spread {
  int64_t task_us, failing;
};

at::Tensor spread(int64_t tasks, int64_t threads, int64_t task_us, int64_t failing) {
  auto ran_by = at::full({tasks}, -1, at::kLong);
  auto wait = [](const void* context, int64_t t) {
    const Spread& s = *static_cast<const Spread*>(context);
    TORCH_CHECK(t != s.failing, "task ", t, " failed");
    Clock::time_point until = Clock::now() + std::chrono::microseconds(s.task_us);
    while (Clock::now() < until) _mm_pause();
  };
  Spread context{task_us, failing};
  pool().run(tasks, threads, wait, &context, ran_by.data_ptr<int64_t>());
  return ran_by;
}

}  // namespace

TORCH_LIBRARY(triforce_pool, m) {
  m.def("address() -> int", &address);
  m.def("helpers() -> int", &helpers);
  m.def("threads() -> int", &threads);
  m.def("set_threads(int count) -> ()", &set_threads);
  m.def("spread(int tasks, int threads, int task_us, int failing=-1) -> Tensor", &spread);
}
