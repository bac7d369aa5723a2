#include "common/call_proto.h"

namespace cache_dit_opd {
namespace {

// opd.proto's DType enum and wire.h's table are the same numbers.
#define CACHE_DIT_OPD_X(e, v, name, bytes, proto)                                  \
  static_assert(static_cast<int>(v1::DTYPE_##proto) == v && static_cast<int>(DType::e) == v, \
                "opd.proto DTYPE_" #proto " differs from wire.h");
CACHE_DIT_OPD_WIRE_DTYPES(CACHE_DIT_OPD_X)
#undef CACHE_DIT_OPD_X
static_assert(v1::DType_ARRAYSIZE == kDTypeCount, "opd.proto has a dtype wire.h does not");

// opd.proto's Reason enum and wire.h's table are the same numbers.
#define CACHE_DIT_OPD_X(e, v, proto, code, action)                                       \
  static_assert(static_cast<int>(v1::REASON_##proto) == v && static_cast<int>(Reason::e) == v, \
                "opd.proto REASON_" #proto " differs from wire.h");
CACHE_DIT_OPD_REASONS(CACHE_DIT_OPD_X)
#undef CACHE_DIT_OPD_X
static_assert(v1::Reason_ARRAYSIZE == v1::kReasonCount, "opd.proto has a reason wire.h does not");


template <typename L>
Status CheckList(int index, const L& list) {
  if (list.values_size() > kMaxListLength) {
    return Status::Rejected(Reason::kBadArgument, "argument ", index, ": list of ", list.values_size(), " values, at most ",
                                   kMaxListLength);
  }
  return Status::Ok();
}

}  // namespace

Status TensorFromProto(std::string_view what, const v1::TensorRef& in, TensorRef* out) {
  if (in.sizes_size() > kMaxTensorDims) {
    return Status::Rejected(Reason::kBadArgument, what, ": tensor has ", in.sizes_size(), " dims, at most ",
                            kMaxTensorDims);
  }
  if (in.sizes_size() != in.strides_size()) {
    return Status::Rejected(Reason::kBadArgument, what, ": tensor has ", in.sizes_size(), " sizes but ",
                            in.strides_size(), " strides");
  }
  const int dtype = static_cast<int>(in.dtype());
  if (!IsWireDType(dtype)) {
    return Status::Rejected(Reason::kBadArgument, what, ": dtype ", dtype, " is not a protocol v1 dtype");
  }
  out->region_id = in.region_id();
  out->byte_offset = in.byte_offset();
  out->sizes.assign(in.sizes().begin(), in.sizes().end());
  out->strides.assign(in.strides().begin(), in.strides().end());
  out->dtype = static_cast<DType>(dtype);
  return Status::Ok();
}

Status CallFromProto(const v1::CallRequest& in, CallRequest* out) {
  if (in.args_size() > kMaxArgs) {
    return Status::Rejected(Reason::kBadArgument, "call has ", in.args_size(), " arguments, at most ", kMaxArgs);
  }
  out->op = in.op();
  out->overload = in.overload();
  out->lane = in.lane();
  out->seq = in.seq();
  out->host_ordered = in.host_ordered();
  out->args.clear();
  out->args.reserve(in.args_size());
  for (int i = 0; i < in.args_size(); ++i) {
    const v1::Argument& a = in.args(i);
    switch (a.value_case()) {
      case v1::Argument::kTensor: {
        TensorRef t;
        OPD_RETURN_IF_ERROR(TensorFromProto("argument " + std::to_string(i), a.tensor(), &t));
        out->args.emplace_back(std::move(t));
        break;
      }
      case v1::Argument::kIntValue:
        out->args.emplace_back(static_cast<int64_t>(a.int_value()));
        break;
      case v1::Argument::kFloatValue:
        out->args.emplace_back(a.float_value());
        break;
      case v1::Argument::kBoolValue:
        out->args.emplace_back(a.bool_value());
        break;
      case v1::Argument::kIntList:
        OPD_RETURN_IF_ERROR(CheckList(i, a.int_list()));
        out->args.emplace_back(std::vector<int64_t>(a.int_list().values().begin(), a.int_list().values().end()));
        break;
      case v1::Argument::kFloatList:
        OPD_RETURN_IF_ERROR(CheckList(i, a.float_list()));
        out->args.emplace_back(std::vector<double>(a.float_list().values().begin(), a.float_list().values().end()));
        break;
      case v1::Argument::kBoolList:
        OPD_RETURN_IF_ERROR(CheckList(i, a.bool_list()));
        out->args.emplace_back(std::vector<bool>(a.bool_list().values().begin(), a.bool_list().values().end()));
        break;
      case v1::Argument::kNone:
        out->args.emplace_back(NoneArg{});
        break;
      case v1::Argument::VALUE_NOT_SET:
        return Status::Rejected(Reason::kBadArgument, "argument ", i, " has no value");
    }
  }
  return Status::Ok();
}


void CallToProto(const CallRequest& in, v1::CallRequest* out) {
  out->set_op(in.op);
  out->set_overload(in.overload);
  out->set_lane(in.lane);
  out->set_seq(in.seq);
  out->set_host_ordered(in.host_ordered);
  out->clear_args();
  for (const Arg& arg : in.args) {
    v1::Argument* a = out->add_args();
    if (std::holds_alternative<NoneArg>(arg)) {
      a->mutable_none();
    } else if (const auto* t = std::get_if<TensorRef>(&arg)) {
      v1::TensorRef* w = a->mutable_tensor();
      w->set_region_id(t->region_id);
      w->set_byte_offset(t->byte_offset);
      for (int64_t v : t->sizes) w->add_sizes(v);
      for (int64_t v : t->strides) w->add_strides(v);
      w->set_dtype(static_cast<v1::DType>(static_cast<int>(t->dtype)));  // the same numbers (above)
    } else if (const auto* v = std::get_if<int64_t>(&arg)) {
      a->set_int_value(*v);
    } else if (const auto* d = std::get_if<double>(&arg)) {
      a->set_float_value(*d);
    } else if (const auto* b = std::get_if<bool>(&arg)) {
      a->set_bool_value(*b);
    } else if (const auto* il = std::get_if<std::vector<int64_t>>(&arg)) {
      // mutable_*_list() sets the oneof even for an empty list, which must
      // travel as a list: an argument with no value is refused on decoding.
      v1::IntList* w = a->mutable_int_list();
      for (int64_t x : *il) w->add_values(x);
    } else if (const auto* fl = std::get_if<std::vector<double>>(&arg)) {
      v1::FloatList* w = a->mutable_float_list();
      for (double x : *fl) w->add_values(x);
    } else if (const auto* bl = std::get_if<std::vector<bool>>(&arg)) {
      v1::BoolList* w = a->mutable_bool_list();
      for (bool x : *bl) w->add_values(x);
    }
  }
}

}  // namespace cache_dit_opd
