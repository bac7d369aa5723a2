"""Per-op call counts of a running daemon, from GetStats and from /metrics, compared (tests/gpu/records.sh).

    python3 tests/gpu/metrics_vs_stats.py SOCKET HOST:PORT

Reads /metrics, then GetStats, then /metrics again: while calls keep coming a row agrees when the GetStats
count lies between the two scrapes. Prints one line per (op, overload, transport) and a last line that
starts with "equal" or "differ".
"""

import sys
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from bench.daemon import SERVICE, _protocol


def scrape(address: str) -> dict:
    body = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    out = {}
    for fam in text_string_to_metric_families(body):
        for s in fam.samples:
            if s.name == "cache_dit_opd_calls_total":
                out[(s.labels["op"], s.labels["overload"], s.labels["transport"])] = int(s.value)
    return out


def get_stats(socket: str):
    grpc, pb = _protocol()
    with grpc.insecure_channel(f"unix:{socket}") as ch:
        fn = ch.unary_unary(SERVICE + "GetStats", request_serializer=pb.StatsRequest.SerializeToString,
                            response_deserializer=pb.StatsReply.FromString)
        return fn(pb.StatsRequest(session_id=0), timeout=10)


def main() -> int:
    socket, address = sys.argv[1], sys.argv[2]
    first = scrape(address)
    stats = get_stats(socket)
    second = scrape(address)
    bad, total = [], 0
    for o in stats.ops:
        key = (o.name, o.overload, o.transport)
        lo, hi = first.get(key, 0), second.get(key, 0)
        total += o.calls
        print(f"{o.name or '(not in the catalog)'}.{o.overload} {o.transport}: GetStats {o.calls}, "
              f"/metrics {lo}..{hi}")
        if not lo <= o.calls <= hi:
            bad.append(key)
    print(f"{'differ' if bad else 'equal'}: {len(stats.ops)} rows, {total} calls (GetStats){'; ' if bad else ''}"
          f"{', '.join(map(str, bad))}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
