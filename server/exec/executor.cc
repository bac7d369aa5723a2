#include "server/exec/executor.h"

#include <algorithm>
#include <array>
#include <cerrno>
#include <thread>

#include <pthread.h>
#include <sys/prctl.h>

#include <spdlog/spdlog.h>

#include "common/cpu_relax.h"
#include "common/futex.h"
#include "server/session/region_registry.h"


namespace cache_dit_opd {

using Clock = std::chrono::steady_clock;

namespace {
int64_t SteadyNanos(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}
}  // namespace

void Executor::Record(Item& item, const Status& outcome, Clock::time_point at) {
  if (item.recorded) return;
  item.recorded = true;
  (outcome.ok() ? item.session->calls : item.session->errors).fetch_add(1, std::memory_order_relaxed);
  item.session->last_call_ns.store(SteadyNanos(at), std::memory_order_relaxed);
  if (!stats_) return;
  stats_->Count(item.row, item.req.transport, outcome);
  stats_->Observe(item.row, item.req.transport, CallStage::kTotal, at - item.received);
}

void Executor::Observe(const Item& item, CallStage stage, Clock::duration d) {
  if (stats_) stats_->Observe(item.row, item.req.transport, stage, d);
}

namespace {
ExecutorOptions WithBusyCount(ExecutorOptions o) {
  if (!o.busy_lanes) o.busy_lanes = std::make_shared<std::atomic<int>>(0);
  return o;
}
}  // namespace

Executor::Executor(DeviceOps* device, CallRunner* runner, DaemonStats* stats, ExecutorOptions options,
                   FatalHook on_fatal)
    : device_(device), runner_(runner), stats_(stats), options_(WithBusyCount(std::move(options))),
      on_fatal_(std::move(on_fatal)) {}

Executor::~Executor() { Stop(); }

void Executor::Start() {
  std::lock_guard<std::mutex> lock(mu_);
  if (started_) return;
  started_ = true;
  thread_ = std::thread([this] { Loop(); });
}

void Executor::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    news_.store(true, std::memory_order_release);
  }
  Wake();
  if (thread_.joinable()) {
    thread_.join();
    return;
  }
  // Never started: run what was handed over so no completion is lost.
  std::vector<Item> intake;
  std::vector<Command> commands;
  {
    std::lock_guard<std::mutex> lock(mu_);
    intake.swap(intake_);
    commands.swap(commands_);
    pending_ = 0;
  }
  for (Item& it : intake) it.done(Status::Rejected(Reason::kDraining, "the daemon is shutting down"));
  for (Command& c : commands) {
    if (c.then) c.then();
  }
}

Status Executor::Enqueue(const std::shared_ptr<Session>& session, Item& item) {
  const uint32_t lane_index = item.req.lane;
  const uint64_t seq = item.req.seq;
  const bool host_ordered = item.req.host_ordered;
  if (lane_index >= session->lane_count()) {
    return Status::Rejected(Reason::kLaneRange, "lane ", lane_index, " out of range: session ", session->id(), " has ",
                                   session->lane_count(), " lane(s)");
  }
  if (host_ordered && seq != 0) {
    return Status::Rejected(Reason::kMalformed, "lane ", lane_index, ": a host-ordered call takes its seq from the ",
                            "daemon, got seq ", seq);
  }
  if (!host_ordered && seq == 0) {
    return Status::Rejected(Reason::kLaneRange, "lane ", lane_index, ": seq 0 is invalid (a lane's first seq is 1)");
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    Lane& lane = session->lane(lane_index);
    if (fatal_) return fatal_status_;
    if (stop_) return Status::Rejected(Reason::kDraining, "the daemon is shutting down");
    if (session->state() != SessionState::kBound) {
      return session->state() == SessionState::kClosed
                 ? Status::Rejected(Reason::kSessionEnded, "session ", session->id(), " has ended")
                 : Status::Rejected(Reason::kSessionUnbound, "session ", session->id(), " is not bound yet");
    }
    if (host_ordered) {
      item.req.seq = lane.next_seq;
    } else if (seq != lane.next_seq) {
      return Status::Rejected(Reason::kLaneSequence, "lane ", lane_index, ": expected seq ", lane.next_seq, ", got ", seq);
    }
    ++lane.next_seq;
    item.held = HeldCall(session.get());
    intake_.push_back(std::move(item));
    ++pending_;
    news_.store(true, std::memory_order_release);
  }
  Wake();
  return Status::Ok();
}

void Executor::Submit(const std::shared_ptr<Session>& session, CallRequest req, Completion done) {
  Item item{.session = session, .req = std::move(req), .done = std::move(done), .received = Clock::now()};
  if (stats_) item.row = stats_->per_op.Row(item.req.op, item.req.overload);
  Status reject = Enqueue(session, item);
  if (!reject.ok()) {
    Record(item, reject, Clock::now());
    item.done(reject);
  }
}

void Executor::SubmitRejected(const std::shared_ptr<Session>& session, uint32_t lane, uint64_t seq,
                              CallTransport transport, Status reason, Completion done) {
  if (reason.ok()) reason = Status::Rejected(Reason::kInternal, "SubmitRejected without a reason");
  CallRequest req;
  req.op = "(rejected by its transport)";
  req.lane = lane;
  req.seq = seq;
  // Answered (and recorded) now, on this thread: the verdict is already
  // known. Queued as answered, so at its turn Finish only writes "done".
  req.transport = transport;
  const Clock::time_point now = Clock::now();
  Item item{.session = session,
            .req = std::move(req),
            .done = [](const Status&) {},
            .received = now,
            .answered_at = now,
            .verdict = reason,
            .answered = true};
  if (stats_) item.row = stats_->per_op.other_row();
  // Its client reads `reason` whether or not the lane takes the seq; when it
  // does not, there is no "done" to write.
  Record(item, reason, item.received);
  static_cast<void>(Enqueue(session, item));
  done(reason);
}

void Executor::DropSession(const std::shared_ptr<Session>& session, Status reason, std::function<void()> then) {
  // Here, not on the executor's thread: that thread may be blocked in a
  // launch onto this session's full lane stream, behind one of these waits.
  if (session) {
    for (uint32_t l = 0; l < session->lane_count(); ++l) {
      session->memory().RaiseInputsReady(l, v1::kInputsReadyReleased);
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    commands_.push_back(Command{session, std::move(reason), std::move(then)});
    news_.store(true, std::memory_order_release);
  }
  Wake();
  std::vector<Command> inline_commands;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Not running: no call of ours is queued; run the continuation here.
    if (!started_ || exited_) inline_commands.swap(commands_);
  }
  for (Command& c : inline_commands) {
    if (c.then) c.then();
  }
}

void Executor::AddRing(std::shared_ptr<CallSource> source) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    ring_intake_.push_back(std::move(source));
    news_.store(true, std::memory_order_release);
  }
  Wake();
}

void Executor::Wake() {
  wake_word_.fetch_add(1, std::memory_order_seq_cst);
  // Dekker with Sleep(): it stores sleeping_ then loads news_; we stored
  // news_ (or stop_) before this, then load sleeping_.
  if (sleeping_.load(std::memory_order_seq_cst)) {
    FutexWake(reinterpret_cast<uint32_t*>(&wake_word_), 1, /*shared=*/false);
  }
}

size_t Executor::PollRings() {
  size_t taken = 0;
  for (auto it = rings_.begin(); it != rings_.end();) {
    if ((*it)->finished()) {
      it = rings_.erase(it);
      continue;
    }
    taken += (*it)->Poll();
    ++it;
  }
  return taken;
}

void Executor::Sleep(std::chrono::nanoseconds timeout) {
  static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t));
  const uint32_t seen = wake_word_.load(std::memory_order_seq_cst);
  sleeping_.store(true, std::memory_order_seq_cst);
  std::vector<FutexWord> words;
  words.reserve(rings_.size() + 1);
  words.push_back(FutexWord{reinterpret_cast<uint32_t*>(&wake_word_), seen, /*shared=*/false});
  size_t armed = 0;
  bool work = news_.load(std::memory_order_seq_cst);
  for (; !work && armed < rings_.size(); ++armed) {
    CallSource& r = *rings_[armed];
    if (!r.ArmSleep()) {
      ++armed;  // armed, then found a record: disarmed below
      work = true;
      break;
    }
    words.push_back(FutexWord{r.doorbell(), r.sleeping_value(), /*shared=*/true});
  }
  if (!work) {
    const long rc = FutexWaitAny(words, timeout);
    if (rc < 0 && errno == EAGAIN && wake_word_.load(std::memory_order_acquire) == seen) {
      // A doorbell was not "sleeping" although we armed it and nothing came:
      // a client scribbles on it. Back off instead of spinning on the call.
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  for (size_t i = 0; i < armed; ++i) rings_[i]->Disarm();
  sleeping_.store(false, std::memory_order_relaxed);
}

size_t Executor::pending() const {
  std::lock_guard<std::mutex> lock(mu_);
  return pending_;
}

bool Executor::failed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return fatal_;
}

void Executor::Fail(const Status& status) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (fatal_) return;
    fatal_ = true;
    fatal_status_ = status;
  }
  Wake();  // its queued calls complete with `status` now
  spdlog::critical("executor: {}; failing every session", status.message());
  if (on_fatal_) on_fatal_(status);
}

void Executor::Finish(LaneQueue& q, Item& item, Status status) {
  Lane& lane = *q.lane;
  const uint64_t seq = item.req.seq;
  bool dead;
  {
    std::lock_guard<std::mutex> lock(mu_);
    dead = fatal_;
  }
  if (!dead) {
    // Shared "done" first, then the daemon's private copy: when the daemon
    // sees its copy reach seq, the client's has too.
    const std::array<uint64_t, 2> addrs{lane.shm_done_address, lane.completed_address};
    bool sticky = false;
    Status w = device_->WriteValue64(lane.stream, addrs, seq, &sticky);
    if (w.ok()) {
      lane.enqueued.store(seq, std::memory_order_release);
    } else {
      spdlog::error("session {} lane {}: writing done={} failed: {}", q.session->id(), lane.index, seq,
                    w.message());
      if (status.ok()) status = w;
      if (sticky) {
        status = Status::Rejected(Reason::kDeviceLost, "sticky CUDA error: ", w.message());
        Fail(status);
      }
    }
  } else if (status.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    status = fatal_status_;
  }
  Record(item, status, Clock::now());
  item.prepared.reset();
  Completion done = std::move(item.done);
  {
    std::lock_guard<std::mutex> lock(mu_);
    --pending_;
  }
  if (!item.answered && item.req.host_ordered && status.ok()) {
    // Answered once the lane stream has passed it (Answer()).
    awaiting_.push_back(Awaiting{q.session, q.lane, seq, std::move(done)});
  } else if (!item.answered) {
    done(status);
  } else if (!status.ok() && item.verdict.ok()) {
    spdlog::error("session {} lane {}: {} (seq {}) failed after it was accepted: {}", q.session->id(),
                  lane.index, item.req.op, seq, status.message());
  }
}

void Executor::Accept(LaneQueue& q, Item& item) {
  CallRegionResolver resolver(&q.session->regions(), q.lane->index, item.req.seq);
  LaneCalls& kept = accepted_[q.lane];
  if (kept.session_id != q.session->id()) kept = LaneCalls{q.session->id()};  // a lane of an earlier session
  const CallRequest& req = item.req;
  AcceptedCall* same = nullptr;
  for (AcceptedCall& c : kept.calls) {
    if (c.prepared && c.op == req.op && c.overload == req.overload && c.args == req.args) same = &c;
  }
  Status s;
  bool reused = false;
  if (same != nullptr) {
    s = runner_->PrepareAgain(req, resolver, same->prepared, &item.prepared, &reused);
  } else {
    s = runner_->PrepareShared(req, resolver, &item.prepared);
  }
  if (s.ok() && !item.prepared) s = Status::Rejected(Reason::kInternal, "dispatch prepared nothing for ", req.op);
  if (s.ok() && !reused) s = runner_->Validate(*item.prepared);
  if (!s.ok()) {
    item.prepared.reset();
  } else if (!reused) {
    AcceptedCall& slot = same != nullptr ? *same : kept.calls[kept.next++ % LaneCalls::kKept];
    slot = AcceptedCall{req.op, req.overload, req.args, item.prepared};
  }
  item.verdict = s;
  item.answered_at = Clock::now();
  Observe(item, CallStage::kAccept, item.answered_at - item.received);
  // A host-ordered call that passed is answered once it has run (Answer()).
  if (item.req.host_ordered && s.ok()) return;
  if (!s.ok()) Record(item, s, item.answered_at);
  item.answered = true;
  Completion done = item.done;
  done(s);
}

bool Executor::Answer() {
  bool progress = false;
  for (auto it = awaiting_.begin(); it != awaiting_.end();) {
    if (it->lane->Completed() >= it->seq) {
      it->done(Status::Ok());
      it = awaiting_.erase(it);
      progress = true;
    } else {
      ++it;
    }
  }
  return progress;
}

void Executor::DropAwaiting(const std::shared_ptr<Session>& session, const Status& reason) {
  for (auto it = awaiting_.begin(); it != awaiting_.end();) {
    if (session && it->session != session) {
      ++it;
      continue;
    }
    it->done(reason);
    it = awaiting_.erase(it);
  }
}

bool Executor::RunReady() {
  bool progress = false;
  bool dead;
  Status fatal_status;
  {
    std::lock_guard<std::mutex> lock(mu_);
    dead = fatal_;
    fatal_status = fatal_status_;
  }
  for (auto qit = queues_.begin(); qit != queues_.end();) {
    LaneQueue& q = qit->second;
    Lane& lane = *q.lane;
    Session& session = *q.session;
    if (session.state() == SessionState::kClosed) {
      // Ended: its DropSession (on its way) answers and completes these;
      // none is validated or launched now. (The check below, after reading
      // inputs_ready, is the one that keeps a raised value from launching.)
      ++qit;
      continue;
    }
    if (!dead) {
      for (; q.validated < q.items.size(); ++q.validated) {
        Item& item = q.items[q.validated];
        if (!item.verdict.ok()) continue;  // its transport rejected it
        Accept(q, item);
        progress = true;
      }
    }
    for (int n = 0; n < options_.max_calls_per_lane_turn && !q.items.empty(); ++n) {
      Item& item = q.items.front();
      if (dead) {
        Finish(q, item, fatal_status);
        q.PopFront();
        progress = true;
        continue;
      }
      if (!item.verdict.ok()) {  // rejected at acceptance: its "done", in order
        Finish(q, item, item.verdict);
        q.PopFront();
        progress = true;
        continue;
      }
      // Inputs not visibly ready: launch ahead behind a GPU wait if the lane
      // holds (or gets) a parking slot, else leave it to the host check. A
      // host-ordered call's inputs were ready before it was sent.
      const uint64_t ready = session.memory().InputsReady(lane.index);
      // Read after `ready`: DropSession raises inputs_ready only after the
      // session was closed, so a raised value is never taken for real inputs.
      if (session.state() == SessionState::kClosed) break;
      // Ready as the GPU's wait would judge it: a client value 2^63 or more
      // ahead passes no wait, so it is no reason to launch without one.
      const bool wait_on_gpu = !item.req.host_ordered && !SessionMemory::Reached(ready, item.req.seq);
      // At most max_calls_ahead calls on the lane stream beyond what it has
      // completed, by the daemon's own record (a full stream queue would
      // block this thread's launches for every session, and no value the
      // client writes may lift the bound).
      if (item.req.seq > lane.Completed() + static_cast<uint64_t>(options_.max_calls_ahead)) break;
      if (wait_on_gpu && !Park(q, item.req.seq)) break;
      const Clock::time_point run_start = Clock::now();
      bool sticky = false;
      Status s = wait_on_gpu ? device_->WaitValue64(lane.stream, lane.shm_inputs_address, item.req.seq, &sticky)
                             : Status::Ok();
      if (s.ok()) s = runner_->Run(*item.prepared, lane.stream, &sticky);
      if (sticky) {
        Status fatal = Status::Rejected(Reason::kDeviceLost, "sticky CUDA error in ", item.req.op, ": ", s.message());
        Fail(fatal);
        dead = true;
        fatal_status = fatal;
        s = fatal;
      }
      Finish(q, item, s);
      Observe(item, CallStage::kInputsWait, run_start - item.answered_at);
      Observe(item, CallStage::kRun, Clock::now() - run_start);
      q.PopFront();
      progress = true;
    }
    if (q.items.empty()) {
      qit = queues_.erase(qit);
    } else {
      ++qit;
    }
  }
  return progress;
}

bool Executor::FewBusyLanes() {
  const int limit = options_.park_busy_lanes;
  if (limit <= 0 || options_.busy_lanes->load(std::memory_order_relaxed) <= limit) return true;
  if (const Clock::time_point now = Clock::now(); now - busy_swept_ >= kBusySweep) SweepBusy(now);
  return options_.busy_lanes->load(std::memory_order_relaxed) <= limit;
}

void Executor::SweepBusy(Clock::time_point now) {
  busy_swept_ = now;
  std::erase_if(busy_, [](const auto& e) { return e.first->Completed() >= e.second.seq; });
  PublishBusy();
}

void Executor::PublishBusy() {
  const int n = static_cast<int>(busy_.size());
  if (n == busy_published_) return;
  options_.busy_lanes->fetch_add(n - busy_published_, std::memory_order_relaxed);
  busy_published_ = n;
}

bool Executor::Park(LaneQueue& q, uint64_t seq) {
  // Many busy lanes: the host check costs the GPU less (options).
  if (!FewBusyLanes()) return false;
  if (auto it = parked_.find(q.lane); it != parked_.end()) {
    it->second.seq = std::max(it->second.seq, seq);
    return true;
  }
  if (options_.parking_slots <= 0) return false;
  if (parked_.size() >= static_cast<size_t>(options_.parking_slots)) ReapParked();
  if (parked_.size() >= static_cast<size_t>(options_.parking_slots)) {
    // Full: take the slot of the lane stalled longest, if past the deadline.
    const Clock::time_point now = Clock::now();
    auto victim = parked_.end();
    for (auto it = parked_.begin(); it != parked_.end(); ++it) {
      // Stalled: its client's inputs are behind the parked seq and its
      // stream has finished nothing for the deadline (a lane whose inputs
      // arrived is busy on the GPU, not stalled).
      const Parked& p = it->second;
      const bool stalled = !SessionMemory::Reached(p.seen, p.seq) && now - p.moved >= options_.park_deadline;
      if (stalled && (victim == parked_.end() || p.moved < victim->second.moved)) victim = it;
    }
    if (victim == parked_.end()) return false;
    Parked stalled = victim->second;
    stalled.session->memory().RaiseInputsReady(stalled.lane->index, stalled.seq);
    parked_.erase(victim);
    const Status why = Status::Rejected(
        Reason::kInputsStalled, "session ", stalled.session->id(), " lane ", stalled.lane->index,
        ": inputs_ready stayed at ", stalled.seen, " below parked call ", stalled.seq, " for ",
        std::chrono::duration_cast<std::chrono::milliseconds>(now - stalled.moved).count(),
        " ms while another lane needed its parking slot; the wait was released and the session ends");
    spdlog::warn("executor: {}", why.message());
    if (options_.on_stalled) options_.on_stalled(stalled.session, why);
  }
  const uint64_t seen = q.session->memory().InputsReady(q.lane->index);
  parked_.emplace(q.lane, Parked{q.session, q.lane, seq, seen, q.lane->Completed(), Clock::now()});
  parked_count_.store(parked_.size(), std::memory_order_release);
  return true;
}

void Executor::ReapParked() {
  const Clock::time_point now = Clock::now();
  for (auto it = parked_.begin(); it != parked_.end();) {
    Parked& p = it->second;
    // Free once the stream finished the parked seq, by the daemon's own
    // record: then no wait of the lane is pending on the GPU. What the client
    // writes cannot free it early (a value it lowers again, or one the GPU's
    // cyclic compare reads as behind, would leave a wait parked uncounted).
    const uint64_t completed = p.lane->Completed();
    if (completed >= p.seq) {
      it = parked_.erase(it);
      continue;
    }
    p.seen = p.session->memory().InputsReady(p.lane->index);
    // Progress is what the stream finished: a client that only moves its
    // inputs_ready back and forth makes none.
    if (completed != p.completed) {
      p.completed = completed;
      p.moved = now;
    }
    ++it;
  }
  parked_count_.store(parked_.size(), std::memory_order_release);
}

void Executor::ReleaseParked(const std::shared_ptr<Session>& session) {
  for (auto it = parked_.begin(); it != parked_.end();) {
    if (session && it->second.session != session) {
      ++it;
      continue;
    }
    it->second.session->memory().RaiseInputsReady(it->second.lane->index, it->second.seq);
    it = parked_.erase(it);
  }
  parked_count_.store(parked_.size(), std::memory_order_release);
}

void Executor::Drop(const std::shared_ptr<Session>& session, const Status& reason) {
  // Parked waits first: what this session has on the GPU must drain.
  ReleaseParked(session);
  std::erase_if(accepted_, [&](const auto& e) { return !session || e.second.session_id == session->id(); });
  std::erase_if(busy_, [&](const auto& e) { return !session || e.second.session == session; });
  PublishBusy();
  for (auto qit = queues_.begin(); qit != queues_.end();) {
    LaneQueue& q = qit->second;
    if (session && q.session != session) {
      ++qit;
      continue;
    }
    bool dead;
    {
      std::lock_guard<std::mutex> lock(mu_);
      dead = fatal_;
    }
    uint64_t last = 0;
    for (Item& item : q.items) last = std::max(last, item.req.seq);
    if (!dead && last > 0) {
      // One write covers every dropped seq: waits are ">= n" and monotone.
      Lane& lane = *q.lane;
      const std::array<uint64_t, 2> addrs{lane.shm_done_address, lane.completed_address};
      bool sticky = false;
      Status w = device_->WriteValue64(lane.stream, addrs, last, &sticky);
      if (w.ok()) {
        lane.enqueued.store(last, std::memory_order_release);
      } else {
        spdlog::error("session {} lane {}: releasing done={} failed: {}", q.session->id(), lane.index, last,
                      w.message());
        if (sticky) Fail(Status::Rejected(Reason::kDeviceLost, "sticky CUDA error: ", w.message()));
      }
    }
    size_t dropped = q.items.size();
    for (Item& item : q.items) {
      item.prepared.reset();
      Record(item, reason, Clock::now());
      if (!item.answered) item.done(reason);
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      pending_ -= dropped;
    }
    qit = queues_.erase(qit);
  }
}

void Executor::Loop() {
  // A 10 us backoff sleep would otherwise last the default 50 us slack.
  prctl(PR_SET_TIMERSLACK, 1000UL, 0UL, 0UL, 0UL);
  pthread_setname_np(pthread_self(), options_.thread_name.substr(0, 15).c_str());
  // No device (a daemon without a GPU serves no session): nothing to enter.
  if (Status entered = device_ != nullptr ? device_->EnterThread() : Status::Ok(); !entered.ok()) {
    Fail(Status::Rejected(Reason::kDeviceLost, "executor thread: ", entered.message()));
  }
  auto spin_until = Clock::now() + options_.spin;
  std::chrono::microseconds backoff{0};
  // Swapped with intake_ each pass and cleared, so both keep their capacity:
  // a call's submission allocates no vector.
  std::vector<Item> intake;
  while (true) {
    const Clock::time_point pass_start = Clock::now();
    // The rings first: what they decode is submitted to us (into intake_)
    // on this thread, and taken just below.
    bool progress = PollRings() > 0;
    std::vector<Command> commands;
    bool stopping = false;
    if (news_.load(std::memory_order_acquire)) {
      std::vector<std::shared_ptr<CallSource>> rings;
      {
        std::lock_guard<std::mutex> lock(mu_);
        intake.swap(intake_);
        commands.swap(commands_);
        rings.swap(ring_intake_);
        stopping = stop_;
        news_.store(false, std::memory_order_relaxed);
      }
      progress = progress || !intake.empty() || !commands.empty() || !rings.empty();
      for (auto& r : rings) rings_.push_back(std::move(r));
    }
    for (Item& item : intake) {
      Lane* lane = &item.session->lane(item.req.lane);
      LaneQueue& q = queues_[lane];
      if (!q.lane) {
        q.lane = lane;
        q.session = item.session;
      }
      Busy& b = busy_[lane];
      if (!b.session) b.session = item.session;
      b.seq = std::max(b.seq, item.req.seq);
      q.items.push_back(std::move(item));
    }
    if (!intake.empty()) PublishBusy();
    intake.clear();
    for (Command& c : commands) {
      Drop(c.session, c.reason);
      DropAwaiting(c.session, c.reason);
      if (c.then) c.then();
    }
    if (stopping) {
      const Status stopped = Status::Rejected(Reason::kDraining, "the daemon is shutting down");
      Drop(nullptr, stopped);
      DropAwaiting(nullptr, stopped);
      rings_.clear();
      std::vector<Command> late;
      {
        std::lock_guard<std::mutex> lock(mu_);
        late.swap(commands_);
        exited_ = true;
      }
      for (Command& c : late) {
        if (c.then) c.then();
      }
      return;
    }

    if (RunReady()) progress = true;
    if (!parked_.empty()) ReapParked();
    if (Answer()) progress = true;
    if (progress) {
      const Clock::time_point now = Clock::now();
      // One writer: a plain store, no locked read-modify-write per pass.
      busy_ns_.store(busy_ns_.load(std::memory_order_relaxed) +
                         static_cast<uint64_t>(std::chrono::nanoseconds(now - pass_start).count()),
                     std::memory_order_relaxed);
      backoff = std::chrono::microseconds{0};
      spin_until = now + options_.spin;
      continue;
    }
    // Spin while progress is recent: the next call of a busy client lands
    // here instead of waking a sleeping thread.
    if (Clock::now() < spin_until) {
      CpuRelax();
      continue;
    }
    // Lanes that finished stop counting as busy for the other executors
    // while this one sleeps.
    if (!busy_.empty()) SweepBusy(Clock::now());
    if (queues_.empty() && awaiting_.empty() && parked_.empty()) {
      Sleep(options_.idle_sleep);
      spin_until = Clock::now();  // after a wake, spin only once something came
    } else {
      // Calls wait for their inputs on the host, or for the GPU.
      backoff = std::min(options_.max_backoff, backoff.count() == 0 ? std::chrono::microseconds{10} : backoff * 2);
      Sleep(backoff);
    }
  }
}

}  // namespace cache_dit_opd
