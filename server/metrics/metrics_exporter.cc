#include "server/metrics/metrics_exporter.h"

#include <sys/resource.h>
#include <unistd.h>

#include <limits>
#include <fstream>
#include <sstream>
#include <utility>
#include <vector>

#include <prometheus/metric_family.h>
#include <prometheus/text_serializer.h>

#include "cache_dit_opd/v1/session_memory.h"

namespace cache_dit_opd {

namespace {

using prometheus::ClientMetric;
using prometheus::MetricFamily;
using prometheus::MetricType;

MetricFamily Family(std::string name, std::string help, MetricType type) {
  return MetricFamily{std::move(name), std::move(help), type, {}};
}

void AddGauge(MetricFamily& f, double value, std::vector<ClientMetric::Label> labels = {}) {
  ClientMetric m;
  m.label = std::move(labels);
  m.gauge.value = value;
  f.metric.push_back(std::move(m));
}

void AddCounter(MetricFamily& f, double value, std::vector<ClientMetric::Label> labels = {}) {
  ClientMetric m;
  m.label = std::move(labels);
  m.counter.value = value;
  f.metric.push_back(std::move(m));
}

void AddHistogram(MetricFamily& f, const LatencyHistogram::Snapshot& h, std::vector<ClientMetric::Label> labels) {
  ClientMetric m;
  m.label = std::move(labels);
  m.histogram.sample_count = h.count;
  m.histogram.sample_sum = h.sum_seconds;
  for (size_t i = 0; i < kLatencyBucketBounds.size(); ++i) {
    m.histogram.bucket.push_back({h.cumulative[i], kLatencyBucketBounds[i]});
  }
  m.histogram.bucket.push_back({h.count, std::numeric_limits<double>::infinity()});
  f.metric.push_back(std::move(m));
}

MetricFamily Single(std::string name, std::string help, MetricType type, double value) {
  MetricFamily f = Family(std::move(name), std::move(help), type);
  type == MetricType::Counter ? AddCounter(f, value) : AddGauge(f, value);
  return f;
}

// process_start_time_seconds: /proc/self/stat's starttime (clock ticks
// after boot) plus /proc/stat's btime. 0 when /proc cannot tell.
double ProcessStartSeconds() {
  std::ifstream stat_file("/proc/self/stat");
  std::string stat((std::istreambuf_iterator<char>(stat_file)), std::istreambuf_iterator<char>());
  const size_t comm_end = stat.rfind(')');  // the command may hold spaces and parentheses
  if (comm_end == std::string::npos) return 0;
  std::istringstream fields(stat.substr(comm_end + 2));
  std::string field;
  for (int i = 3; i < 22 && fields >> field; ++i) {
  }
  unsigned long long start_ticks = 0;
  if (!(fields >> start_ticks)) return 0;
  std::ifstream proc_stat("/proc/stat");
  for (std::string line; std::getline(proc_stat, line);) {
    if (line.rfind("btime ", 0) == 0) {
      return std::stod(line.substr(6)) + static_cast<double>(start_ticks) / static_cast<double>(sysconf(_SC_CLK_TCK));
    }
  }
  return 0;
}

double ResidentBytes() {
  std::ifstream statm("/proc/self/statm");
  unsigned long long size = 0, resident = 0;
  if (!(statm >> size >> resident)) return 0;
  return static_cast<double>(resident) * static_cast<double>(sysconf(_SC_PAGESIZE));
}

double CpuSeconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  auto secs = [](const timeval& t) { return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_usec) * 1e-6; };
  return secs(u.ru_utime) + secs(u.ru_stime);
}

}  // namespace

class MetricsExporter::Collector {
 public:
  explicit Collector(const Daemon* daemon) : daemon_(daemon), start_seconds_(ProcessStartSeconds()) {}

  std::vector<MetricFamily> Collect() const {
    std::vector<MetricFamily> out;
    const VersionInfo v = daemon_->Version();
    const DaemonInfo& i = v.info;
    MetricFamily info = Family("cache_dit_opd_info", "The daemon's build and GPU (value 1)", MetricType::Gauge);
    AddGauge(info, 1,
             {{"version", i.daemon_version},
              {"git_commit", i.git_commit},
              {"torch_version", i.torch_version},
              {"cuda_runtime_version", std::to_string(i.cuda_runtime_version)},
              {"cuda_driver_version", std::to_string(i.cuda_driver_version)},
              {"protocol_version", std::to_string(v.protocol_version)},
              {"gpu_uuid", i.gpu_uuid},
              {"gpu_name", i.gpu_name},
              {"device_index", std::to_string(i.device_index)}});
    out.push_back(std::move(info));

    MetricFamily health = Family("cache_dit_opd_health",
                                 "1 for the daemon's current health state (device_lost: a sticky CUDA error)",
                                 MetricType::Gauge);
    const std::pair<const char*, Reason> states[] = {{"serving", Reason::kUnspecified},
                                                    {"no_device", Reason::kNotServing},
                                                    {"draining", Reason::kDraining},
                                                    {"device_lost", Reason::kDeviceLost}};
    for (const auto& [state, reason] : states) AddGauge(health, v.health_reason == reason ? 1 : 0, {{"state", state}});
    out.push_back(std::move(health));

    AddCallFamilies(&out);

    const StatsSnapshot g = daemon_->Gauges();
    uint64_t lanes = 0, pending_unmaps = 0, ring_slots = 0, ring_pending = 0;
    for (const SessionStatsEntry& s : g.sessions_detail) {
      lanes += s.lanes;
      pending_unmaps += s.regions.pending_unmaps;
      ring_slots += s.ring_slots;
      ring_pending += s.ring_pending;
    }
    const auto gauge = MetricType::Gauge;
    out.push_back(Single("cache_dit_opd_sessions", "Open sessions", gauge, static_cast<double>(g.sessions)));
    out.push_back(Single("cache_dit_opd_lanes", "Lanes of all open sessions", gauge, static_cast<double>(lanes)));
    out.push_back(Single("cache_dit_opd_regions", "Client allocations mapped, all sessions", gauge,
                         static_cast<double>(g.regions)));
    out.push_back(Single("cache_dit_opd_mapped_bytes", "Bytes of client memory mapped, all sessions", gauge,
                         static_cast<double>(g.mapped_bytes)));
    out.push_back(Single("cache_dit_opd_pending_unmaps", "Regions waiting for their last call to finish", gauge,
                         static_cast<double>(pending_unmaps)));
    out.push_back(Single("cache_dit_opd_ring_slots", "Call-ring slots of all sessions", gauge,
                         static_cast<double>(ring_slots)));
    out.push_back(Single("cache_dit_opd_ring_pending_records",
                         "Call-ring records published by clients and not yet taken, all sessions", gauge,
                         static_cast<double>(ring_pending)));
    out.push_back(Single("cache_dit_opd_store_entries", "Weight-store entries published", gauge,
                         static_cast<double>(g.store_entries)));
    out.push_back(Single("cache_dit_opd_store_bytes",
                         "Weight-store bytes in use (deleted entries still used by a call or mapping included)", gauge,
                         static_cast<double>(g.store_bytes)));
    out.push_back(Single("cache_dit_opd_store_max_bytes", "The weight store's limit, --max-store-bytes (0: off)",
                         gauge, static_cast<double>(g.store_max_bytes)));
    out.push_back(Single("cache_dit_opd_executor_threads",
                         "Executor threads polling the call rings and launching (--executor-threads)", gauge,
                         static_cast<double>(g.executor_threads)));
    MetricFamily per_executor =
        Family("cache_dit_opd_executor_sessions", "Open sessions served by each executor thread", MetricType::Gauge);
    std::vector<uint64_t> served(g.executor_threads, 0);
    for (const SessionStatsEntry& s : g.sessions_detail) {
      if (s.executor >= 0 && static_cast<size_t>(s.executor) < served.size()) ++served[s.executor];
    }
    for (size_t e = 0; e < served.size(); ++e) {
      AddGauge(per_executor, static_cast<double>(served[e]), {{"executor", std::to_string(e)}});
    }
    out.push_back(std::move(per_executor));
    MetricFamily busy = Family("cache_dit_opd_executor_busy_seconds_total",
                               "Time each executor thread spent in passes that did work (not idle polling or asleep); "
                               "its rate is the thread's saturation",
                               MetricType::Counter);
    for (size_t e = 0; e < g.executor_busy_ns.size(); ++e) {
      AddCounter(busy, static_cast<double>(g.executor_busy_ns[e]) * 1e-9, {{"executor", std::to_string(e)}});
    }
    out.push_back(std::move(busy));
    out.push_back(Single("cache_dit_opd_sessions_closed_total", "Sessions ended since start (closed, dead or dropped)",
                         MetricType::Counter, static_cast<double>(g.sessions_closed)));
    out.push_back(Single("process_cpu_seconds_total", "User and system CPU time of the daemon", MetricType::Counter,
                         CpuSeconds()));
    out.push_back(Single("process_resident_memory_bytes", "Resident memory of the daemon", gauge, ResidentBytes()));
    out.push_back(Single("process_start_time_seconds", "Start time of the daemon since the Unix epoch", gauge,
                         start_seconds_));
    return out;
  }

 private:
  void AddCallFamilies(std::vector<MetricFamily>* out) const {
    MetricFamily calls = Family("cache_dit_opd_calls_total", "Calls run, by op overload and transport", MetricType::Counter);
    MetricFamily rejections = Family("cache_dit_opd_call_rejections_total",
                                     "Calls rejected or failed, by op overload, transport and reason",
                                     MetricType::Counter);
    MetricFamily stages = Family("cache_dit_opd_call_stage_seconds",
                                 "Daemon-side time of a call's stages: accept, inputs_wait, run",
                                 MetricType::Histogram);
    MetricFamily duration = Family("cache_dit_opd_call_duration_seconds",
                                   "Daemon-side time of a call, receive to completion", MetricType::Histogram);
    const CallMetrics& m = daemon_->call_metrics();
    for (size_t row = 0; row < m.rows(); ++row) {
      for (CallTransport t : {CallTransport::kGrpc, CallTransport::kRing}) {
        const OpCallCounters& c = m.counters(row, t);
        const std::vector<ClientMetric::Label> labels{
            {"op", m.op(row).name}, {"overload", m.op(row).overload}, {"transport", CallTransportName(t)}};
        const uint64_t n = c.calls.load(std::memory_order_relaxed);
        bool any = n > 0;
        for (uint32_t r = 0; r < v1::kReasonCount; ++r) {
          const uint64_t k = c.rejections[r].load(std::memory_order_relaxed);
          if (k == 0) continue;
          any = true;
          auto with_reason = labels;
          with_reason.push_back({"reason", ReasonName(static_cast<Reason>(r))});
          AddCounter(rejections, static_cast<double>(k), std::move(with_reason));
        }
        if (!any) continue;
        AddCounter(calls, static_cast<double>(n), labels);
        for (size_t st = 0; st < kCallStageCount; ++st) {
          const auto stage = static_cast<CallStage>(st);
          const LatencyHistogram::Snapshot h = c.stages[st].Read();
          if (stage == CallStage::kTotal) {
            AddHistogram(duration, h, labels);
            continue;
          }
          auto with_stage = labels;
          with_stage.push_back({"stage", CallStageName(stage)});
          AddHistogram(stages, h, std::move(with_stage));
        }
      }
    }
    for (MetricFamily* f : {&calls, &rejections, &stages, &duration}) {
      if (!f->metric.empty()) out->push_back(std::move(*f));
    }
  }

  const Daemon* const daemon_;
  const double start_seconds_;
};

MetricsExporter::MetricsExporter(const Daemon* daemon)
    : collector_(std::make_unique<Collector>(daemon)), http_([this] { return Render(); }) {}

MetricsExporter::~MetricsExporter() { Stop(); }

Status MetricsExporter::Start(const std::string& address) {
  OPD_RETURN_IF_ERROR(http_.Start(address));
  address_ = address;
  return Status::Ok();
}

void MetricsExporter::Stop() { http_.Stop(); }

std::string MetricsExporter::Render() const {
  return prometheus::TextSerializer().Serialize(collector_->Collect());
}

}  // namespace cache_dit_opd
