// The library's own worker threads: run_on_pool(n, job) runs job() on the calling thread and on up to n - 1 workers
// at once and returns when every copy that started has returned. A job takes its work from a shared counter until
// none is left, so a worker that starts late (on a busy machine a woken thread may wait milliseconds for a core)
// finds nothing to do, and once the caller's own copy has returned no further worker starts it.
//
// Workers wait on a condition variable (a futex: no spinning), between calls and while the caller finishes its
// share; a caller whose workers are still busy sleeps the same way. On a machine with other work that matters: a
// spinning thread holds a core that the thread it waits for, or another process, needs (GNU OpenMP's threads spin
// for milliseconds after every parallel region). The pool grows to the largest n asked for and keeps its threads;
// calls from several threads at once take turns. After fork() the child starts a pool of its own (the parent's
// workers do not exist there).
//
// workers_with_a_cpu() says how many workers would find a CPU that no other process runs on now, so that a caller
// can leave out those that would only share a CPU with another process: woken when no CPU is idle, such a worker
// queues on the caller's own CPU (the two then take turns on one CPU), or it is preempted for a whole scheduler
// tick (4 ms at 250 Hz) while it holds a share of the work and the caller waits for it (measured: two threads
// beside one busy process on two CPUs were up to 30% slower than one).
#pragma once

#include <pthread.h>
#include <unistd.h>
#ifdef __linux__
#include <dirent.h>
#include <fcntl.h>
#include <sys/syscall.h>
#endif

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace attnops {

class Pool {
 public:
  void run(int n, const std::function<void()>& job) {
    std::lock_guard<std::mutex> turn(call_);  // one call at a time
    const int helpers = n - 1;
    {
      std::lock_guard<std::mutex> lock(mu_);
      while (static_cast<int>(workers_.size()) < helpers) {
        const int id = static_cast<int>(workers_.size());
        workers_.emplace_back([this, id] { serve(id); });
        workers_.back().detach();  // the pool is never destroyed (threads blocked at exit are fine)
      }
      job_ = &job;
      wanted_ = helpers;
      open_ = true;
      ++generation_;
    }
    wake_.notify_all();
    job();
    std::unique_lock<std::mutex> lock(mu_);
    open_ = false;  // a worker that wakes only now stays out: the caller waits for none that never started
    done_.wait(lock, [this] { return inside_ == 0; });
  }

 private:
  void serve(int id) {
    uint64_t seen = 0;
    for (;;) {
      const std::function<void()>* job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        wake_.wait(lock, [&] { return generation_ != seen && id < wanted_; });
        seen = generation_;
        if (!open_) continue;
        ++inside_;
        job = job_;
      }
      (*job)();
      std::lock_guard<std::mutex> lock(mu_);
      if (--inside_ == 0) done_.notify_one();
    }
  }

  std::mutex call_, mu_;
  std::condition_variable wake_, done_;
  std::vector<std::thread> workers_;
  const std::function<void()>* job_ = nullptr;
  int wanted_ = 0, inside_ = 0;  // workers asked to help; workers running the job now
  bool open_ = false;            // the job still takes workers
  uint64_t generation_ = 0;
};

inline Pool*& pool_slot() {
  static Pool* pool = [] {
    pthread_atfork(nullptr, nullptr, [] { pool_slot() = new Pool(); });  // the parent's pool (and its locks) stay
    return new Pool();
  }();
  return pool;
}

#ifdef __linux__
// The number of tasks that /proc/loadavg counts as running or waiting to run now, system-wide; -1 where unknown.
// The file stays open (one read per call: an open costs tens of microseconds on a busy virtual machine).
inline long runnable_tasks() {
  static const int fd = open("/proc/loadavg", O_RDONLY | O_CLOEXEC);
  char text[128];
  const ssize_t got = fd < 0 ? -1 : pread(fd, text, sizeof text - 1, 0);
  if (got <= 0) return -1;
  text[got] = 0;
  const char* p = text;  // "avg1 avg5 avg15 runnable/total last-pid"
  for (int spaces = 0; *p && spaces < 3; ++p) spaces += *p == ' ';
  long count = 0;
  for (; *p >= '0' && *p <= '9'; ++p) count = count * 10 + (*p - '0');
  return *p == '/' ? count : -1;
}

// The ids of this process's threads other than the calling one, listed from /proc/self/task at most every 100 ms
// per calling thread (threads come and go rarely, and a listing costs tens of microseconds on a busy virtual
// machine; a forked child lists its own).
inline const std::vector<long>& other_threads() {
  thread_local std::vector<long> tids;
  thread_local pid_t listed_by = 0;
  thread_local std::chrono::steady_clock::time_point listed_at;
  const auto now = std::chrono::steady_clock::now();
  if (listed_by == getpid() && now - listed_at < std::chrono::milliseconds(100)) return tids;
  listed_by = getpid();
  listed_at = now;
  tids.clear();
  DIR* dir = opendir("/proc/self/task");
  if (!dir) return tids;
  const long me = syscall(SYS_gettid);
  while (const dirent* entry = readdir(dir)) {
    char* end = nullptr;
    const long tid = std::strtol(entry->d_name, &end, 10);
    if (end != entry->d_name && !*end && tid != me) tids.push_back(tid);
  }
  closedir(dir);
  return tids;
}

// This process's threads other than the calling one that are running or waiting to run now (the state in
// /proc/self/task/*/stat; PyTorch's OpenMP threads, for one, spin for milliseconds after each parallel region),
// counted up to `enough`; 0 without reading a thread's state where there are fewer than `least` other threads.
inline long own_runnable_threads(long least, long enough) {
  const std::vector<long>& others = other_threads();
  long count = 0;
  if (static_cast<long>(others.size()) < least) return 0;
  for (size_t i = 0; i < others.size() && count < enough; ++i) {
    char path[64], text[128];
    std::snprintf(path, sizeof path, "/proc/self/task/%ld/stat", others[i]);
    const int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;  // the thread has ended
    const ssize_t got = read(fd, text, sizeof text - 1);
    close(fd);
    if (got <= 0) continue;
    text[got] = 0;
    const char* name_end = std::strrchr(text, ')');  // "tid (name) state ..."
    count += name_end && name_end[1] == ' ' && name_end[2] == 'R';
  }
  return count;
}

// How many of `wanted` workers would each find a CPU that no other process runs on now: the online CPUs less the
// calling thread and the runnable tasks of other processes (Linux); `wanted` where that is unknown. This process's
// own runnable threads are not counted (they are looked at only when the other tasks leave too few CPUs): they are
// its own work, or OpenMP threads that will sleep soon.
inline int workers_with_a_cpu(int wanted) {
  static const long cpus = sysconf(_SC_NPROCESSORS_ONLN);  // read once: a file read as well
  const long runnable = runnable_tasks();
  if (cpus < 1 || runnable < 1) return wanted;
  long free = cpus - runnable;  // the caller is one of the runnable tasks
  if (free < wanted) free += own_runnable_threads(1 - free, wanted - free);
  return static_cast<int>(free < 0 ? 0 : (free < wanted ? free : wanted));
}
#else
inline int workers_with_a_cpu(int wanted) { return wanted; }  // no cheap count of the runnable tasks
#endif

// GNU OpenMP's GOMP_parallel (the entry point of `#pragma omp parallel`) in the copy PyTorch loaded, once the
// library is given it (attnops_use_openmp_team); null otherwise and in a forked child, whose OpenMP threads do not
// exist (GNU OpenMP would wait for them forever).
using OpenMPParallel = void (*)(void (*)(void*), void*, unsigned, unsigned);
inline OpenMPParallel& openmp_team() {
  static OpenMPParallel entry = [] {
    pthread_atfork(nullptr, nullptr, [] { openmp_team() = nullptr; });
    return OpenMPParallel{nullptr};
  }();
  return entry;
}

// job() on the calling thread and n - 1 workers (n < 2: on the calling thread alone): PyTorch's OpenMP threads
// where the library has them, else the library's own pool. OpenMP's threads spin for milliseconds after every
// parallel region (the PyTorch operators' before this call, say); the pool's workers would share the CPUs with
// them, while the same threads take this job at once. Either way a thread that starts late finds no work left.
inline void run_on_pool(int n, const std::function<void()>& job) {
  if (n < 2) {
    job();
    return;
  }
  if (OpenMPParallel parallel = openmp_team()) {
    parallel([](void* f) { (*static_cast<const std::function<void()>*>(f))(); },
             const_cast<std::function<void()>*>(&job), static_cast<unsigned>(n), 0);
    return;
  }
  pool_slot()->run(n, job);
}

}  // namespace attnops
