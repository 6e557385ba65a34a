// Collectives among the ranks of one host through a shared-memory segment (shiftlm/comm/shm.py), as
// vLLM's CPU backend does for its tensor-parallel all-reduce: a rank copies its data into its own
// slot, publishes the slot's generation number (release), waits until every rank has published that
// generation (acquire), then reads the slots it needs. No socket, no helper thread, no condition
// variable: on a virtual machine each sleep-and-wake of gloo's path cost ~1-2 ms (docs/serving.md).
//
// Segment: `world` headers of 64 bytes (generation, pid), then two buffers (generation parity) of
// `world` slots of `capacity` bytes. A rank writes buffer g % 2 at generation g only after it has seen
// every rank publish g - 1, i.e. after every rank finished reading g - 2 from that buffer: no rank
// overwrites data another still reads. Larger tensors go in chunks, one generation each.
//
// Waiting: spin (pause) for `spin_s`, then yield the core (sched_yield: another thread or process of
// this core runs) until `yield_s`, then sleep on a futex in the segment (shared between processes; the
// publisher wakes sleepers, so an idle rank uses no CPU), waking every 10 ms to check that the ranks
// not yet there are alive (their pid) and the deadline (`timeout_s` > 0). The GIL is released.
#include <torch/extension.h>

#include <errno.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

struct alignas(64) Header {
  int64_t gen;      // the generation this rank published; its low 32 bits are the futex word
  int64_t pid;      // this rank's process id (a peer that exited is named, not waited for)
  int32_t waiters;  // ranks sleeping on this header's futex (the publisher wakes them only then)
};

constexpr int64_t kHeaderBytes = 64;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// Whether process `pid` has exited: gone (ESRCH), or a zombie that its parent has not reaped yet (a
// worker rank that died while rank 0, its parent, waits here: kill(pid, 0) still succeeds for it).
bool exited(int64_t pid) {
  if (pid <= 0) return false;
  if (kill(static_cast<pid_t>(pid), 0) != 0) return errno == ESRCH;
  char path[64], stat[512];
  std::snprintf(path, sizeof(path), "/proc/%lld/stat", static_cast<long long>(pid));
  FILE* file = std::fopen(path, "r");
  if (file == nullptr) return false;
  const size_t n = std::fread(stat, 1, sizeof(stat) - 1, file);
  std::fclose(file);
  stat[n] = '\0';
  const char* paren = std::strrchr(stat, ')');  // "pid (comm) S ...": the state follows the name
  return paren != nullptr && paren[1] == ' ' && (paren[2] == 'Z' || paren[2] == 'X');
}

struct Segment {
  char* base;
  int64_t world, capacity;
  Header* header(int64_t rank) const { return reinterpret_cast<Header*>(base + rank * kHeaderBytes); }
  char* slot(int64_t gen, int64_t rank) const {
    const int64_t data = ((world * kHeaderBytes + 4095) / 4096) * 4096;
    return base + data + ((gen & 1) * world + rank) * capacity;
  }
};

Segment segment_of(const torch::Tensor& seg, int64_t world, int64_t capacity) {
  TORCH_CHECK(seg.is_contiguous() && seg.scalar_type() == at::kByte, "shm: a contiguous uint8 segment");
  const int64_t data = ((world * kHeaderBytes + 4095) / 4096) * 4096;
  TORCH_CHECK(seg.numel() >= data + 2 * world * capacity, "shm: segment too small");
  return Segment{reinterpret_cast<char*>(seg.data_ptr<uint8_t>()), world, capacity};
}

struct Policy {
  double spin_s, yield_s, timeout_s;
};

int32_t* futex_word(Header* h) { return reinterpret_cast<int32_t*>(&h->gen); }  // little-endian: low half

void publish(const Segment& s, int64_t rank, int64_t gen) {
  Header* h = s.header(rank);
  __atomic_store_n(&h->gen, gen, __ATOMIC_SEQ_CST);
  if (__atomic_load_n(&h->waiters, __ATOMIC_SEQ_CST) > 0) {  // a peer sleeps: wake it (shared futex)
    syscall(SYS_futex, futex_word(h), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
  }
}

// Sleep until this header's generation word changes from `seen` (or 10 ms pass: the caller then checks
// that the rank is alive and the deadline).
void sleep_on(Header* h, int64_t seen) {
  __atomic_add_fetch(&h->waiters, 1, __ATOMIC_SEQ_CST);
  if (__atomic_load_n(&h->gen, __ATOMIC_SEQ_CST) == seen) {
    timespec nap{0, 10 * 1000 * 1000};
    syscall(SYS_futex, futex_word(h), FUTEX_WAIT, static_cast<int32_t>(seen), &nap, nullptr, 0);
  }
  __atomic_sub_fetch(&h->waiters, 1, __ATOMIC_SEQ_CST);
}

// until every rank has published `gen`
void wait_all(const Segment& s, int64_t gen, const Policy& p) {
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  for (int64_t j = 0; j < s.world; ++j) {
    Header* h = s.header(j);
    int64_t polls = 0, seen;
    while ((seen = __atomic_load_n(&h->gen, __ATOMIC_ACQUIRE)) < gen) {
      if ((++polls & 31) != 0) {
        cpu_relax();
        continue;
      }
      const double waited = std::chrono::duration<double>(clock::now() - start).count();
      if (waited < p.spin_s) {
        cpu_relax();
      } else if (waited < p.yield_s) {
        sched_yield();
      } else {
        const int64_t pid = __atomic_load_n(&h->pid, __ATOMIC_ACQUIRE);
        if (exited(pid)) {
          throw std::runtime_error("shm collective: local rank " + std::to_string(j) + " (pid " +
                                   std::to_string(pid) + ") exited");
        }
        if (p.timeout_s > 0 && waited > p.timeout_s) {
          throw std::runtime_error("shm collective: local rank " + std::to_string(j) + " did not arrive within " +
                                   std::to_string(p.timeout_s) + " s");
        }
        sleep_on(h, seen);
      }
    }
  }
}

template <typename T>
void sum_slots(const Segment& s, int64_t gen, int64_t count, T* out) {
  const T* first = reinterpret_cast<const T*>(s.slot(gen, 0));
  std::memcpy(out, first, count * sizeof(T));
  for (int64_t j = 1; j < s.world; ++j) {  // rank order on every rank: the same bits everywhere
    const T* part = reinterpret_cast<const T*>(s.slot(gen, j));
#pragma omp simd
    for (int64_t i = 0; i < count; ++i) out[i] += part[i];
  }
}

}  // namespace

// The segment's header for this rank: generation 0, its pid.
void shm_init(const torch::Tensor& seg, int64_t rank, int64_t world, int64_t capacity) {
  Segment s = segment_of(seg, world, capacity);
  __atomic_store_n(&s.header(rank)->pid, static_cast<int64_t>(getpid()), __ATOMIC_RELEASE);
  publish(s, rank, 0);
}

// In-place sum of `t` (contiguous fp32/fp64) over the ranks; returns the last generation used.
int64_t shm_all_reduce(const torch::Tensor& seg, int64_t rank, int64_t world, int64_t gen, torch::Tensor t,
                       int64_t capacity, double spin_s, double yield_s, double timeout_s) {
  TORCH_CHECK(t.is_contiguous() && t.device().is_cpu(), "shm_all_reduce: a contiguous CPU tensor");
  Segment s = segment_of(seg, world, capacity);
  Policy p{spin_s, yield_s, timeout_s};
  AT_DISPATCH_FLOATING_TYPES(t.scalar_type(), "shm_all_reduce", [&] {
    scalar_t* data = t.data_ptr<scalar_t>();
    const int64_t per = capacity / static_cast<int64_t>(sizeof(scalar_t));
    for (int64_t done = 0, n = t.numel(); done < n || (n == 0 && done == 0); done += per) {
      const int64_t count = std::min(per, n - done);
      ++gen;
      std::memcpy(s.slot(gen, rank), data + done, count * sizeof(scalar_t));
      publish(s, rank, gen);
      wait_all(s, gen, p);
      sum_slots(s, gen, count, data + done);
      if (n == 0) break;
    }
  });
  return gen;
}

// Every rank's `input` (same byte size on all) into `out` ([world * bytes], uint8 view) on the ranks
// with `receive`; ranks without it only publish. Broadcast: the root publishes, the others pass an
// empty input and read the root's slot (`from_rank`). Returns the last generation used.
int64_t shm_gather(const torch::Tensor& seg, int64_t rank, int64_t world, int64_t gen, torch::Tensor input,
                   torch::Tensor out, int64_t from_rank, int64_t capacity, double spin_s, double yield_s,
                   double timeout_s) {
  TORCH_CHECK(input.is_contiguous() && out.is_contiguous(), "shm_gather: contiguous tensors");
  Segment s = segment_of(seg, world, capacity);
  Policy p{spin_s, yield_s, timeout_s};
  const char* in = reinterpret_cast<const char*>(input.data_ptr());
  char* dst = out.numel() ? reinterpret_cast<char*>(out.data_ptr()) : nullptr;
  const int64_t in_bytes = input.numel() * input.element_size();
  const int64_t out_bytes = out.numel() * out.element_size();
  // bytes per rank: the input's (gather), or what the output holds (a broadcast's receivers)
  const int64_t bytes = from_rank >= 0 ? std::max(in_bytes, out_bytes) : in_bytes;
  TORCH_CHECK(from_rank >= 0 || out_bytes == 0 || out_bytes == world * bytes, "shm_gather: out size");
  for (int64_t done = 0; done < bytes || done == 0; done += capacity) {
    const int64_t count = std::min(capacity, bytes - done);
    ++gen;
    if (in_bytes) std::memcpy(s.slot(gen, rank), in + done, count);
    publish(s, rank, gen);
    wait_all(s, gen, p);
    if (dst != nullptr) {
      if (from_rank >= 0) {
        std::memcpy(dst + done, s.slot(gen, from_rank), count);
      } else {
        for (int64_t j = 0; j < world; ++j) std::memcpy(dst + j * bytes + done, s.slot(gen, j), count);
      }
    }
    if (bytes == 0) break;
  }
  return gen;
}

// ---------------------------------------------------------------------------------------------------
// Point-to-point rings (shiftlm/comm/shm_p2p.py): one single-producer, single-consumer byte ring per
// ordered pair of ranks that talk, and one doorbell per rank. A ring's header holds `head` (bytes ever
// written, by the sender only) and `tail` (bytes ever read, by the receiver only), each on its own cache
// line; the data area of `capacity` bytes follows. `ring_put` / `ring_get` never block: they move what
// fits now and return the byte count, then ring the other side's doorbell (a counter and futex word in
// that rank's 64-byte header: the ring's receiver after a put, its sender after a get), waking it only
// when it sleeps. Message framing, matching and progress live in Python; a waiting rank reads its
// doorbell, makes what progress it can, and sleeps with `doorbell_wait` until the value moves.

namespace {

struct alignas(64) Doorbell {
  int32_t bell;     // futex word: bumped by a peer after it put data for us or took data we put
  int32_t waiters;  // this rank sleeps on it (the peer wakes only then)
  int64_t pid;      // this rank's process id
};

struct RingHeader {
  alignas(64) int64_t head;
  alignas(64) int64_t tail;
};

constexpr int64_t kRingHeaderBytes = 128;

char* seg_base(const torch::Tensor& seg) {
  TORCH_CHECK(seg.is_contiguous() && seg.scalar_type() == at::kByte, "shm p2p: a contiguous uint8 segment");
  return reinterpret_cast<char*>(seg.data_ptr<uint8_t>());
}

Doorbell* doorbell_of(char* base, int64_t rank) { return reinterpret_cast<Doorbell*>(base + rank * 64); }

void ring_bell(Doorbell* d) {
  __atomic_add_fetch(&d->bell, 1, __ATOMIC_SEQ_CST);
  if (__atomic_load_n(&d->waiters, __ATOMIC_SEQ_CST) > 0) {
    syscall(SYS_futex, &d->bell, FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
  }
}

char* byte_ptr(const torch::Tensor& t, int64_t offset, int64_t nbytes) {
  TORCH_CHECK(t.is_contiguous() && t.device().is_cpu(), "shm p2p: a contiguous CPU tensor");
  TORCH_CHECK(offset >= 0 && offset + nbytes <= t.numel() * t.element_size(), "shm p2p: bytes out of range");
  return nbytes == 0 ? nullptr : reinterpret_cast<char*>(t.data_ptr()) + offset;
}

}  // namespace

void p2p_init(const torch::Tensor& seg, int64_t rank) {
  Doorbell* d = doorbell_of(seg_base(seg), rank);
  __atomic_store_n(&d->pid, static_cast<int64_t>(getpid()), __ATOMIC_RELEASE);
}

// Copy up to `nbytes` of `src` (from byte `offset`) into the ring at `ring` (byte offset in the segment);
// returns how many fit now, and rings `bell_rank`'s doorbell if any did.
int64_t ring_put(const torch::Tensor& seg, int64_t ring, int64_t capacity, const torch::Tensor& src, int64_t offset,
                 int64_t nbytes, int64_t bell_rank) {
  char* base = seg_base(seg);
  auto* h = reinterpret_cast<RingHeader*>(base + ring);
  char* data = base + ring + kRingHeaderBytes;
  const int64_t head = h->head;  // only this side writes it
  const int64_t tail = __atomic_load_n(&h->tail, __ATOMIC_ACQUIRE);
  const int64_t n = std::min(nbytes, capacity - (head - tail));
  if (n <= 0) return 0;
  const char* from = byte_ptr(src, offset, n);
  const int64_t at = head % capacity, first = std::min(n, capacity - at);
  std::memcpy(data + at, from, first);
  if (n > first) std::memcpy(data, from + first, n - first);
  __atomic_store_n(&h->head, head + n, __ATOMIC_RELEASE);
  ring_bell(doorbell_of(base, bell_rank));
  return n;
}

// Copy up to `nbytes` out of the ring into `dst` (from byte `offset`); returns how many were there, and
// rings `bell_rank`'s doorbell (the sender's: space was freed) if any were.
int64_t ring_get(const torch::Tensor& seg, int64_t ring, int64_t capacity, const torch::Tensor& dst, int64_t offset,
                 int64_t nbytes, int64_t bell_rank) {
  char* base = seg_base(seg);
  auto* h = reinterpret_cast<RingHeader*>(base + ring);
  const char* data = base + ring + kRingHeaderBytes;
  const int64_t tail = h->tail;  // only this side writes it
  const int64_t head = __atomic_load_n(&h->head, __ATOMIC_ACQUIRE);
  const int64_t n = std::min(nbytes, head - tail);
  if (n <= 0) return 0;
  char* to = byte_ptr(dst, offset, n);
  const int64_t at = tail % capacity, first = std::min(n, capacity - at);
  std::memcpy(to, data + at, first);
  if (n > first) std::memcpy(to + first, data, n - first);
  __atomic_store_n(&h->tail, tail + n, __ATOMIC_RELEASE);
  ring_bell(doorbell_of(base, bell_rank));
  return n;
}

// Bytes waiting in the ring (written, not yet read).
int64_t ring_pending(const torch::Tensor& seg, int64_t ring) {
  auto* h = reinterpret_cast<RingHeader*>(seg_base(seg) + ring);
  return __atomic_load_n(&h->head, __ATOMIC_ACQUIRE) - __atomic_load_n(&h->tail, __ATOMIC_ACQUIRE);
}

int64_t doorbell_read(const torch::Tensor& seg, int64_t rank) {
  return __atomic_load_n(&doorbell_of(seg_base(seg), rank)->bell, __ATOMIC_ACQUIRE);
}

// Wait until this rank's doorbell differs from `seen` (spin, then yield, then sleep on its futex); every
// 10 ms of sleep, check that the ranks in `peers` live and the deadline (`timeout_s` > 0, counted from
// `started_s` ago). Returns the doorbell's new value.
int64_t doorbell_wait(const torch::Tensor& seg, int64_t rank, int64_t seen, std::vector<int64_t> peers,
                      double waited_s, double spin_s, double yield_s, double timeout_s) {
  using clock = std::chrono::steady_clock;
  char* base = seg_base(seg);
  Doorbell* d = doorbell_of(base, rank);
  const auto start = clock::now();
  int64_t polls = 0;
  for (;;) {
    const int32_t now = __atomic_load_n(&d->bell, __ATOMIC_ACQUIRE);
    if (now != static_cast<int32_t>(seen)) return now;
    if ((++polls & 31) != 0) {
      cpu_relax();
      continue;
    }
    const double waited = waited_s + std::chrono::duration<double>(clock::now() - start).count();
    if (waited < spin_s) {
      cpu_relax();
    } else if (waited < yield_s) {
      sched_yield();
    } else {
      for (int64_t peer : peers) {
        const int64_t pid = __atomic_load_n(&doorbell_of(base, peer)->pid, __ATOMIC_ACQUIRE);
        if (exited(pid)) {
          throw std::runtime_error("shm p2p: local rank " + std::to_string(peer) + " (pid " + std::to_string(pid) +
                                   ") exited");
        }
      }
      if (timeout_s > 0 && waited > timeout_s) {
        throw std::runtime_error("shm p2p: no message from local ranks within " + std::to_string(timeout_s) + " s");
      }
      __atomic_add_fetch(&d->waiters, 1, __ATOMIC_SEQ_CST);
      if (__atomic_load_n(&d->bell, __ATOMIC_SEQ_CST) == static_cast<int32_t>(seen)) {
        timespec nap{0, 10 * 1000 * 1000};
        syscall(SYS_futex, &d->bell, FUTEX_WAIT, static_cast<int32_t>(seen), &nap, nullptr, 0);
      }
      __atomic_sub_fetch(&d->waiters, 1, __ATOMIC_SEQ_CST);
    }
  }
}

void register_shm(pybind11::module& m) {
  using release = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("shm_init", &shm_init, "publish this rank's pid and generation 0 in a shm segment", release());
  m.def("shm_all_reduce", &shm_all_reduce, "in-place sum over the local ranks of a shm segment", release());
  m.def("shm_gather", &shm_gather, "gather / broadcast through a shm segment", release());
  m.def("p2p_init", &p2p_init, "publish this rank's pid in a shm p2p segment", release());
  m.def("ring_put", &ring_put, "copy what fits into a shm p2p ring (never blocks)", release());
  m.def("ring_get", &ring_get, "copy what is there out of a shm p2p ring (never blocks)", release());
  m.def("ring_pending", &ring_pending, "bytes waiting in a shm p2p ring", release());
  m.def("doorbell_read", &doorbell_read, "a rank's shm p2p doorbell", release());
  m.def("doorbell_wait", &doorbell_wait, "sleep until a rank's shm p2p doorbell moves", release());
}
