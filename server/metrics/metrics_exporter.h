// File: server/metrics/metrics_exporter.h
//
// Prometheus metrics of one daemon at http://<--metrics-address>/metrics
// (server/metrics/metrics_http.h serves them; prometheus-cpp's metric
// families and text serializer write them). Everything is read at
// scrape time from what the daemon keeps anyway; nothing is pushed on the
// call path beyond the per-op table's relaxed atomic adds
// (server/exec/call_metrics.h).
//
// Families (Prometheus conventions: base units, _total for counters; label
// values of `op`/`overload` come from the daemon's catalog, never from a
// client: names the catalog does not hold are counted under op="" ):
//
//   cache_dit_opd_info{version, git_commit, torch_version, cuda_runtime_version,
//       cuda_driver_version, protocol_version, gpu_uuid, gpu_name, device_index}   gauge, 1
//   cache_dit_opd_health{state="serving"|"no_device"|"draining"|"device_lost"}      gauge, 1 for the current
//       state, 0 for the others ("device_lost" is the sticky CUDA error)
//   cache_dit_opd_calls_total{op, overload, transport}                             counter: calls run
//   cache_dit_opd_call_rejections_total{op, overload, transport, reason}           counter: rejected or
//       failed, by wire.h Reason name (BAD_ARGUMENT, ...; UNSPECIFIED when none given)
//   cache_dit_opd_call_stage_seconds{op, overload, transport, stage}               histogram; stage
//       "accept" (receive -> answered), "inputs_wait" (answered -> run start), "run" (launch -> "done" enqueued)
//   cache_dit_opd_call_duration_seconds{op, overload, transport}                   histogram, receive ->
//       completion
//   cache_dit_opd_sessions, _lanes, _regions, _mapped_bytes, _pending_unmaps       gauges, all sessions
//   cache_dit_opd_ring_slots, cache_dit_opd_ring_pending_records                  gauges: call-ring slots
//       of every session, records published and not yet taken
//   cache_dit_opd_store_entries, _store_bytes, _store_max_bytes                   gauges: the weight store
//       (server/store/weight_store.h; all 0 when it is off)
//   cache_dit_opd_executor_threads                                                 gauge: --executor-threads
//   cache_dit_opd_executor_sessions{executor}                                      gauge: open sessions each
//       executor thread serves (a session counts once its first call or ring picked one)
//   cache_dit_opd_executor_busy_seconds_total{executor}                            counter: time in passes
//       that did work (server/exec/executor.h busy_ns); its rate is the thread's saturation
//   cache_dit_opd_sessions_closed_total                                            counter
//   process_cpu_seconds_total, process_resident_memory_bytes, process_start_time_seconds
//
// transport is "grpc" or "ring". A row appears once it has a call (counters
// and histograms of ops never called are left out).
//
// Scraping takes, briefly, the session table's lock and each session's
// region-table lock (to count), and the daemon's state lock: each is held
// by the call path for a lookup at most, and by a scrape for a copy of a
// few fields. It never takes the latency reservoirs' locks (GetStats does).
#pragma once

#include <memory>
#include <string>

#include "common/status.h"
#include "server/daemon.h"
#include "server/metrics/metrics_http.h"

namespace cache_dit_opd {

class MetricsExporter {
 public:
  explicit MetricsExporter(const Daemon* daemon);
  ~MetricsExporter();
  MetricsExporter(const MetricsExporter&) = delete;
  MetricsExporter& operator=(const MetricsExporter&) = delete;

  // Listens on `address` (HOST:PORT, options.h CheckMetricsAddress).
  // UNAVAILABLE naming the address when it cannot be bound.
  Status Start(const std::string& address);
  // The address served; "" before Start.
  const std::string& address() const { return address_; }
  // Stops serving (joins the endpoint's thread). Idempotent.
  void Stop();

  // The exposition text a scrape would get (tests, and `opdctl`-less debugging).
  std::string Render() const;

 private:
  class Collector;
  std::unique_ptr<Collector> collector_;
  MetricsHttpServer http_;
  std::string address_;
};

}  // namespace cache_dit_opd
