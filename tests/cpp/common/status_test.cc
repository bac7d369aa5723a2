// Status and the reason table (common/status.h, proto/cache_dit_opd/v1/wire.h):
// every reason is built with its code, named, read back from the wire and
// mapped to its action; errors without a reason act by their code. The
// Python client reads the same table (generated _wire.py) and is held to the
// same rules by tests/python/test_client_reasons.py.
#include <gtest/gtest.h>

#include <set>
#include <string>
#include <vector>

#include "common/status.h"

namespace cache_dit_opd {
namespace {

using v1::ClientAction;

struct Row {
  Reason reason;
  uint32_t value;
  std::string name;
  int code;
  ClientAction action;
};

const std::vector<Row>& Table() {
  static const std::vector<Row> rows = {
#define CACHE_DIT_OPD_X(e, v, proto, code, action) {Reason::e, v, #proto, code, ClientAction::action},
      CACHE_DIT_OPD_REASONS(CACHE_DIT_OPD_X)
#undef CACHE_DIT_OPD_X
  };
  return rows;
}

TEST(ReasonTable, ValuesAreDenseFromOneAndNamesUnique) {
  std::set<std::string> names;
  uint32_t expect = 1;
  for (const Row& r : Table()) {
    EXPECT_EQ(r.value, expect++) << r.name;
    EXPECT_TRUE(names.insert(r.name).second) << r.name;
    EXPECT_NE(r.code, 0) << r.name << ": a reason is an error";
  }
}

TEST(ReasonTable, RejectedCarriesTheReasonItsCodeAndItsAction) {
  for (const Row& r : Table()) {
    const Status s = Status::Rejected(r.reason, "value ", 7);
    EXPECT_EQ(static_cast<int>(s.code()), r.code) << r.name;
    EXPECT_EQ(s.reason(), r.reason);
    EXPECT_EQ(s.action(), r.action) << r.name;
    EXPECT_EQ(ReasonName(r.reason), r.name);
    EXPECT_EQ(ReasonFromWire(r.value), r.reason);
    EXPECT_EQ(s.ToString(), std::string(StatusCodeName(s.code())) + " [" + r.name + "]: value 7");
    // Context on the way up keeps what a client decides by.
    const Status up = s.Annotated("calling x: ");
    EXPECT_EQ(up.reason(), r.reason);
    EXPECT_EQ(up.code(), s.code());
    EXPECT_EQ(up.message(), "calling x: value 7");
  }
}

TEST(ReasonTable, UnknownReasonsAndBareCodesActByTheCode) {
  EXPECT_EQ(ReasonFromWire(0), Reason::kUnspecified);
  EXPECT_EQ(ReasonFromWire(9999), Reason::kUnspecified);
  EXPECT_EQ(ReasonName(static_cast<Reason>(9999)), "REASON(9999)");
  EXPECT_EQ(ReasonName(Reason::kUnspecified), "UNSPECIFIED");
  EXPECT_EQ(v1::ActionOf(0, 0), ClientAction::kNone);
  EXPECT_EQ(v1::ActionOf(0, 4), ClientAction::kNone);  // OK whatever the reason field says
#define CACHE_DIT_OPD_X(code, action)                               \
  EXPECT_EQ(v1::ActionOf(code, 0), ClientAction::action) << code; \
  EXPECT_EQ(v1::ActionOf(code, 9999), ClientAction::action) << code;
  CACHE_DIT_OPD_CODE_ACTIONS(CACHE_DIT_OPD_X)
#undef CACHE_DIT_OPD_X
  EXPECT_EQ(v1::ActionOf(13, 0), ClientAction::kFail);  // INTERNAL is not listed: the session fails
  EXPECT_EQ(Status::Internal("x").action(), ClientAction::kFail);
  EXPECT_EQ(Status::InvalidArgument("x").action(), ClientAction::kRaiseValue);
  EXPECT_EQ(Status::InvalidArgument("x").WithReason(Reason::kRegionUnknown).action(), ClientAction::kReregister);
  EXPECT_EQ(Status::Ok().WithReason(Reason::kClosed).reason(), Reason::kUnspecified);  // OK stays OK
}

}  // namespace
}  // namespace cache_dit_opd
