// Accelerate's distributed operations: nested data, collectives over it,
// objects, process control, reproducibility and debug mode. Linked into the
// same test binary as test_accel.cpp (same suites, same launcher).

#include "test_helpers.hpp"

#include <random>

namespace {
using Batch = std::map<std::string, at::Tensor>;

at::Tensor longs(std::vector<int64_t> v) { return at::tensor(v, at::kLong); }

std::vector<int64_t> values(const at::Tensor& t) {
  at::Tensor c = t.to(at::kLong).contiguous();
  return {c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel()};
}

std::vector<int64_t> range(int64_t first, int64_t last) {  // [first, last]
  std::vector<int64_t> out;
  for (int64_t i = first; i <= last; ++i) out.push_back(i);
  return out;
}

std::vector<int64_t> shape(const at::Tensor& t) { return {t.sizes().begin(), t.sizes().end()}; }

// The rows every rank contributes to the uneven gather: rank r has r+1.
std::vector<int64_t> uneven_rows(int P, int64_t scale) {
  std::vector<int64_t> out;
  for (int r = 0; r < P; ++r)
    for (int i = 0; i <= r; ++i) out.push_back(scale * r);
  return out;
}

int64_t text_hash(const std::string& text) {
  return static_cast<int64_t>(accel::detail::fnv1a(text.data(), text.size()));
}
// A one-rank Gloo group made with c10d directly, with its FileStore in dir: accel registers
// nothing about it. (detail::new_group wraps the backend in a ProcessGroup on LibTorch 2.x.)
accel::GroupPtr raw_gloo_group(const std::string& dir) {
  auto store = c10::make_intrusive<c10d::FileStore>(dir + "/store", 1);
  auto options = c10d::ProcessGroupGloo::Options::create();
  options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  return accel::detail::new_group<c10d::ProcessGroupGloo>(store, 0, 1, options, c10::DeviceType::CPU,
                                                          std::chrono::seconds(60));
}
}  // namespace

// == single ===================================================================

TEST_SUITE("single") {
  TEST_CASE("print: bools as true/false, floating point in the fewest digits that read back (Python's print)") {
    std::ostringstream captured;
    std::streambuf* const saved = std::cout.rdbuf(captured.rdbuf());
    accel::print("loss", 0.1, 1.0 / 3, 2.5f, true, false, 7, 1e-7);
    std::cout.rdbuf(saved);
    CHECK(captured.str() == "loss 0.1 0.3333333333333333 2.5 true false 7 1e-07\n");
  }
  TEST_CASE("nested data: send_to_device, find_batch_size, find_device") {
    Batch batch{{"input_ids", longs({1, 2, 3, 4, 5, 6}).view({2, 3})}, {"labels", longs({0, 1})}};
    auto moved = accel::send_to_device(batch, c10::Device(c10::kMeta), false, {"labels"});
    CHECK(moved["input_ids"].is_meta());
    CHECK(moved["labels"].device().is_cpu());     // skipped key
    CHECK(batch["input_ids"].device().is_cpu());  // the input is not touched

    std::tuple<at::Tensor, std::string, std::vector<int>> mixed{at::ones({4, 2}), "name", {1, 2}};
    auto mixed_meta = accel::send_to_device(mixed, c10::Device(c10::kMeta));
    CHECK(std::get<0>(mixed_meta).is_meta());
    CHECK(std::get<1>(mixed_meta) == "name");  // other leaves pass through
    CHECK(std::get<2>(mixed_meta) == std::vector<int>{1, 2});

    CHECK(accel::find_batch_size(batch) == 2);  // "input_ids" comes first in key order
    CHECK(accel::find_batch_size(mixed) == 4);
    CHECK_FALSE(accel::find_batch_size(std::vector<int>{1, 2}).has_value());
    CHECK_THROWS_AS(accel::find_batch_size(at::ones({})), std::invalid_argument);
    CHECK(accel::find_device(mixed_meta) == c10::Device(c10::kMeta));
    CHECK_FALSE(accel::find_device(std::string("no tensors")).has_value());
    // unordered maps are walked in key order too: every rank agrees.
    std::unordered_map<std::string, at::Tensor> u{{"z", at::ones({5})}, {"a", at::ones({7})}, {"m", at::ones({6})}};
    CHECK(accel::find_batch_size(u) == 7);
  }

  TEST_CASE("nested data: slice_tensors, concatenate, convert_to_fp32, recursively_apply") {
    Batch batch{{"input_ids", longs({1, 2, 3, 4, 5, 6}).view({2, 3})}, {"labels", longs({0, 1})}};
    auto first = accel::slice_tensors(batch, 0);
    CHECK(values(first["input_ids"]) == std::vector<int64_t>{1, 2, 3});
    CHECK(first["labels"].dim() == 0);
    auto head = accel::slice_tensors(batch, at::indexing::Slice(1, 2));
    CHECK(shape(head["input_ids"]) == std::vector<int64_t>{1, 3});
    CHECK(values(head["labels"]) == std::vector<int64_t>{1});

    auto both = accel::concatenate(std::vector<Batch>{batch, batch});
    CHECK(shape(both["input_ids"]) == std::vector<int64_t>{4, 3});
    CHECK(values(both["labels"]) == std::vector<int64_t>{0, 1, 0, 1});
    Batch other{{"input_ids", longs({1})}, {"mask", longs({1})}};
    CHECK_THROWS_WITH_AS(accel::concatenate(std::vector<Batch>{batch, other}),
                         doctest::Contains("element 1 is laid out as {'input_ids': tensor, 'mask': tensor}"),
                         std::invalid_argument);
    CHECK_THROWS_AS(accel::concatenate(std::vector<Batch>{}), std::invalid_argument);

    std::vector<at::Tensor> mixed{at::ones({2}, at::kHalf), at::ones({2}, at::kBFloat16), at::ones({2}, at::kLong)};
    auto fp32 = accel::convert_to_fp32(mixed);
    CHECK((fp32[0].scalar_type() == at::kFloat));
    CHECK((fp32[1].scalar_type() == at::kFloat));
    CHECK((fp32[2].scalar_type() == at::kLong));

    auto doubled = accel::recursively_apply([](const at::Tensor& t) { return t * 2; }, batch, {"labels"});
    CHECK(values(doubled["input_ids"]) == std::vector<int64_t>{2, 4, 6, 8, 10, 12});
    CHECK(values(doubled["labels"]) == std::vector<int64_t>{0, 1});
  }

  TEST_CASE("not distributed: the operations are local") {
    std::tuple<at::Tensor, std::vector<at::Tensor>> data{at::tensor(2.0), {at::ones({2, 2})}};
    auto gathered = accel::gather(data);
    CHECK(shape(std::get<0>(gathered)) == std::vector<int64_t>{1});  // 0-d becomes 1-d
    CHECK(shape(std::get<1>(gathered)[0]) == std::vector<int64_t>{2, 2});
    at::Tensor x = at::ones({3});
    at::Tensor reduced = accel::reduce(x, "sum");
    reduced.add_(1);
    CHECK(x.sum().item<double>() == 3.0);  // reduce works on a copy
    CHECK_THROWS_WITH_AS(accel::reduce(x, "average"), doctest::Contains("unknown reduction 'average'"),
                         std::invalid_argument);
    CHECK_THROWS_WITH_AS(accel::reduce(longs({1}), "mean"), doctest::Contains("accel::reduce: ReduceOp::MEAN"),
                         std::invalid_argument);
    CHECK_THROWS_AS(accel::broadcast(data, 1), std::invalid_argument);
    CHECK(accel::gather_object(std::vector<int>{7, 8}) == std::vector<int>{7, 8});
    CHECK(accel::gather_object(std::string("a")) == std::vector<std::string>{"a"});
    CHECK(accel::split_between_processes(range(0, 16)) == range(0, 16));
    CHECK(accel::split_between_processes(std::map<std::string, std::vector<int>>{}).empty());
    CHECK(accel::copy_tensor_to_devices(x).is_same(x));
    CHECK_THROWS_WITH_AS(accel::copy_tensor_to_devices(at::Tensor()), doctest::Contains("(no process does)"),
                         std::invalid_argument);
  }

  TEST_CASE("split arithmetic: 17 and 8 items on 1, 2, 3 and 4 ranks") {
    const std::map<std::pair<int64_t, int>, std::vector<int64_t>> expected{
        {{17, 1}, {17}}, {{17, 2}, {9, 8}}, {{17, 3}, {6, 6, 5}}, {{17, 4}, {5, 4, 4, 4}},
        {{8, 1}, {8}},   {{8, 2}, {4, 4}},  {{8, 3}, {3, 3, 2}},  {{8, 4}, {2, 2, 2, 2}}};
    for (const auto& [key, lengths] : expected) {
      const auto [n, P] = key;
      int64_t next = 0;
      for (int r = 0; r < P; ++r) {
        auto range = accel::detail::split_range(n, r, P);
        CHECK(range.begin == next);  // contiguous, in rank order
        CHECK(range.end - range.begin == lengths[r]);
        CHECK(range.target == lengths[0]);
        next = range.end;
      }
      CHECK(next == n);
    }
    // More ranks than items: Accelerate gives the late ranks an empty share.
    CHECK(accel::detail::split_range(2, 3, 4).begin == 2);
    CHECK(accel::detail::split_range(2, 3, 4).end == 2);
    CHECK(accel::detail::split_range(2, 3, 4).target == 1);
  }

  TEST_CASE("objects: a round trip keeps every value; corrupted or truncated bytes throw, never crash") {
    using Record =
        std::tuple<std::string, int64_t, double, std::vector<int>, std::map<std::string, double>, at::Tensor>;
    Record record{"text", -5, 0.25, {1, 2, 3}, {{"accuracy", 0.95}, {"f1", 0.93}}, at::arange(4)};
    auto bytes = accel::detail::save_object(accel::detail::to_ivalue(record));
    auto back = accel::detail::from_ivalue<Record>(accel::detail::load_object(bytes.data(), bytes.size()));
    CHECK(std::get<0>(back) == "text");
    CHECK(std::get<1>(back) == -5);
    CHECK(std::get<2>(back) == 0.25);
    CHECK(std::get<3>(back) == std::vector<int>{1, 2, 3});
    CHECK(std::get<4>(back).at("f1") == 0.93);
    CHECK(values(std::get<5>(back)) == std::vector<int64_t>{0, 1, 2, 3});
    CHECK_THROWS_AS(accel::detail::from_ivalue<std::vector<std::string>>(accel::detail::to_ivalue(record)),
                    std::invalid_argument);

    // Every truncation and every single flipped byte is caught.
    for (std::size_t size = 0; size < bytes.size(); ++size)
      CHECK_THROWS_AS(accel::detail::load_object(bytes.data(), size), std::runtime_error);
    for (std::size_t i = 0; i < bytes.size(); ++i) {
      auto flipped = bytes;
      flipped[i] = static_cast<char>(flipped[i] ^ 0x5a);
      CHECK_THROWS_AS(accel::detail::load_object(flipped.data(), flipped.size()), std::runtime_error);
    }
  }

  TEST_CASE("ACCEL_DEBUG_MODE: 1/0, true/false, yes/no, on/off; anything else is an error") {
    for (const char* on : {"1", "true", "TRUE", "yes", "On"}) {
      EnvGuard env{{"ACCEL_DEBUG_MODE", on}};
      accel::set_debug_mode(std::nullopt);
      CHECK(accel::debug_mode());
    }
    for (const char* off : {"0", "false", "no", "OFF"}) {
      EnvGuard env{{"ACCEL_DEBUG_MODE", off}};
      accel::set_debug_mode(std::nullopt);
      CHECK_FALSE(accel::debug_mode());
    }
    {
      EnvGuard env{{"ACCEL_DEBUG_MODE", "2"}};
      accel::set_debug_mode(std::nullopt);
      CHECK_THROWS_WITH_AS(accel::debug_mode(), doctest::Contains("ACCEL_DEBUG_MODE='2' is not a switch"),
                           std::invalid_argument);
      // An interface refuses to start with it, rather than fail mid-training.
      CHECK_THROWS_AS(accel::DistributedInterface::instance(), std::invalid_argument);
    }
    EnvGuard env{{"ACCEL_DEBUG_MODE", nullptr}};
    accel::set_debug_mode(std::nullopt);
    CHECK_FALSE(accel::debug_mode());
  }

  TEST_CASE("debug mode on a group made with c10d directly: a clear error until set_debug_mode sets its check up") {
    // The check is reached through a pointer that registering a group or set_debug_mode sets
    // (registration.hpp); start as a process where neither has happened yet.
    auto& verify = accel::detail::registry().verify_same_call;
    const auto installed = verify.exchange(nullptr);
    char dir[] = "/tmp/accel_raw_group_XXXXXX";
    REQUIRE(mkdtemp(dir) != nullptr);
    {
      const accel::GroupPtr group = raw_gloo_group(dir);
      EnvGuard env{{"ACCEL_DEBUG_MODE", "1"}};
      accel::set_debug_mode(std::nullopt);  // sets the check up (it is a switch of debug mode)
      CHECK(accel::all_reduce(3, accel::ReduceOp::SUM, group) == 3);
      verify.store(nullptr);  // back to a process that only read ACCEL_DEBUG_MODE
      CHECK_THROWS_WITH_AS(accel::all_reduce(3, accel::ReduceOp::SUM, group),
                           doctest::Contains("call accel::set_debug_mode(true) before using a group made with c10d"),
                           std::logic_error);
      accel::set_debug_mode(true);
      CHECK(accel::all_reduce(3, accel::ReduceOp::SUM, group) == 3);
      CHECK((verify.load() == &accel::detail::verify_same_call));
      accel::set_debug_mode(false);
      CHECK(accel::all_reduce(3, accel::ReduceOp::SUM, group) == 3);
    }
    accel::set_debug_mode(std::nullopt);
    if (installed) verify.store(installed);
    std::filesystem::remove_all(dir);
  }

  TEST_CASE("a failed operation on a group made with c10d directly: named in full once any accel group exists") {
    // failure() reaches the full text through a pointer that registering a group sets
    // (registration.hpp); a process that never made one gets the operation and the cause.
    auto& explain = accel::detail::registry().explain_failure;
    const auto installed = explain.exchange(nullptr);
    char dir[] = "/tmp/accel_raw_failure_XXXXXX";
    REQUIRE(mkdtemp(dir) != nullptr);
    {
      const accel::GroupPtr group = raw_gloo_group(dir);
      // (c10d's calls cannot be made to fail on one healthy rank on demand: the issuing step is given a call that throws.)
      auto fail = [&] {
        accel::detail::issue("all_reduce", *group, []() -> c10::intrusive_ptr<c10d::Work> {
          throw std::runtime_error("Connection closed by peer");
        });
      };
      CHECK_THROWS_WITH_AS(fail(), "accel::all_reduce failed: Connection closed by peer", accel::DistributedError);
      explain.store(&accel::detail::explain_failure);
      CHECK_THROWS_WITH_AS(fail(),
                           "accel::all_reduce failed on group 'unnamed' (gloo, rank 0 of 1): Connection closed by peer",
                           accel::DistributedError);
    }
    explain.store(installed);
    std::filesystem::remove_all(dir);
  }
}

// == ranks: the same cases at 1, 2, 3 and 4 ranks ==============================

TEST_SUITE("ranks") {
  TEST_CASE("gather: arange(P) + 1 + P*rank gathers to 1..P^2; nested data; 0-d becomes 1-d") {
    auto& d = world();
    const int P = d.get_world_size(), r = d.get_rank();
    at::Tensor mine = at::arange(P, at::kLong) + 1 + P * r;
    CHECK(values(accel::gather(mine)) == range(1, int64_t{P} * P));
    std::map<std::string, std::tuple<at::Tensor, at::Tensor>> nested{
        {"a", {mine.to(at::kFloat), at::tensor(static_cast<double>(r))}}};
    auto gathered = accel::gather(nested);
    CHECK(values(std::get<0>(gathered["a"])) == range(1, int64_t{P} * P));
    CHECK((std::get<0>(gathered["a"]).scalar_type() == at::kFloat));
    CHECK(values(std::get<1>(gathered["a"])) == range(0, P - 1));
  }

  TEST_CASE("gather: uneven rows (rank r passes r+1) arrive in rank order, trimmed, on every rank") {
    auto& d = world();
    const int P = d.get_world_size(), r = d.get_rank();
    at::Tensor rows = at::full({r + 1, 3}, r, at::kFloat);
    at::Tensor all = accel::gather(rows);
    CHECK(shape(all) == std::vector<int64_t>{P * (P + 1) / 2, 3});
    CHECK(values(all.select(1, 2)) == uneven_rows(P, 1));
    // Several dtypes in one structure (an odd number of bytes before 4- and 8-byte leaves), plus a 0-d leaf.
    std::map<std::string, at::Tensor> batch{{"a", at::full({r + 1}, r % 2 == 1, at::kBool)},
                                            {"x", rows},
                                            {"y", at::full({r + 1}, 10 * r, at::kLong)},
                                            {"z", at::tensor(static_cast<double>(r))},
                                            {"empty", at::empty({0, 2}, at::kInt)}};
    auto g = accel::gather(batch);
    std::vector<int64_t> odd;
    for (int64_t v : uneven_rows(P, 1)) odd.push_back(v % 2);
    CHECK(values(g["a"].to(at::kLong)) == odd);
    CHECK(values(g["x"].select(1, 0)) == uneven_rows(P, 1));
    CHECK(values(g["y"]) == uneven_rows(P, 10));
    CHECK(values(g["z"]) == range(0, P - 1));
    CHECK(shape(g["empty"]) == std::vector<int64_t>{0, 2});
  }

  TEST_CASE("reduce: sum, mean, max and min on a copy; Accelerate's 2-rank values") {
    auto& d = world();
    const int P = d.get_world_size(), r = d.get_rank();
    at::Tensor x = at::arange(2, at::kFloat) + 1 + 2 * r;
    const at::Tensor before = x.clone();
    auto as_doubles = [](const at::Tensor& t) { return std::vector<double>{t[0].item<double>(), t[1].item<double>()}; };
    const double p = P;
    CHECK(as_doubles(accel::reduce(x, "sum")) == std::vector<double>{p + p * (p - 1), 2 * p + p * (p - 1)});
    CHECK(as_doubles(accel::reduce(x, "mean")) == std::vector<double>{p, p + 1});
    CHECK(as_doubles(accel::reduce(x, "max")) == std::vector<double>{2 * p - 1, 2 * p});
    CHECK(as_doubles(accel::reduce(x, ReduceOp::MIN)) == std::vector<double>{1, 2});
    if (P == 2) {
      CHECK(as_doubles(accel::reduce(x, "sum")) == std::vector<double>{4, 6});
      CHECK(as_doubles(accel::reduce(x, "mean")) == std::vector<double>{2, 3});
      CHECK(as_doubles(accel::reduce(x, "max")) == std::vector<double>{3, 4});
    }
    CHECK(at::equal(x, before));
    CHECK_THROWS_WITH_AS(accel::reduce(x, "product"), doctest::Contains("unknown reduction 'product'"),
                         std::invalid_argument);
  }

  TEST_CASE("reduce: a map of 50 small float tensors is one collective") {
    auto& d = world();
    const int P = d.get_world_size();
    auto key = [](int i) { return std::to_string(100 + i); };  // (not "m" + ...: GCC 12's -Wrestrict false positive)
    std::map<std::string, at::Tensor> metrics;
    for (int i = 0; i < 50; ++i) metrics[key(i)] = at::full({i % 4 + 1}, i + d.get_rank(), at::kFloat);
    accel::GroupPtr g = d.world_group();
    start_sequence(g);
    const auto before = g->getSequenceNumberForGroup();
    auto summed = accel::reduce(metrics, "sum");
    CHECK(g->getSequenceNumberForGroup() - before == 1);
    for (int i = 0; i < 50; ++i) {
      const auto& t = summed[key(i)];
      CHECK(t.numel() == i % 4 + 1);
      CHECK(t[0].item<double>() == P * i + P * (P - 1) / 2.0);
    }
  }

  TEST_CASE("broadcast: nested tensors of several dtypes, in place, from any rank of the group") {
    auto& d = world();
    const int P = d.get_world_size(), r = d.get_rank();
    const int src = P - 1;
    std::map<std::string, at::Tensor> state{
        {"w", at::full({2, 3}, r, at::kFloat)}, {"step", longs({r, r})}, {"flag", at::full({1}, r == src, at::kBool)}};
    at::Tensor w = state["w"];
    accel::broadcast(state, src);
    CHECK(values(w.flatten()) == std::vector<int64_t>(6, src));  // the caller's tensor, in place
    CHECK(values(state["step"]) == std::vector<int64_t>{src, src});
    CHECK(state["flag"].item<bool>());
    CHECK_THROWS_WITH_AS(accel::broadcast(state, P), doctest::Contains(("from_process=" + std::to_string(P)).c_str()),
                         std::invalid_argument);
  }

  // Accelerate's test_ops.py test_copy_tensor_to_devices (its expected
  // values), then other shapes, dtypes and holders, and the two mistakes.
  TEST_CASE("copy_tensor_to_devices: the one holder's tensor on every rank, its shape unknown to the others") {
    auto& d = world();
    const int P = d.get_world_size(), r = d.get_rank();
    at::Tensor tensor = r == 0 ? at::tensor({1, 2, 3}, at::kInt) : at::Tensor();
    at::Tensor copied = accel::copy_tensor_to_devices(tensor);
    CHECK(copied.equal(at::tensor({1, 2, 3}, at::kInt)));
    if (r == 0) CHECK(copied.is_same(tensor));  // the holder keeps its own
    const int holder = P - 1;
    const at::Tensor whole = at::arange(24, at::kDouble).reshape({2, 3, 4}).transpose(0, 2);  // not contiguous
    copied = accel::copy_tensor_to_devices(r == holder ? whole : at::Tensor());
    CHECK(shape(copied) == std::vector<int64_t>{4, 3, 2});
    CHECK((copied.scalar_type() == at::kDouble));
    CHECK(copied.equal(whole));
    CHECK(
        accel::copy_tensor_to_devices(r == holder ? at::full({}, true, at::kBool) : at::Tensor()).item<bool>());  // 0-d
    if (P < 2) return;
    CHECK_THROWS_WITH_AS(accel::copy_tensor_to_devices(at::Tensor()), doctest::Contains("(none does)"),
                         std::invalid_argument);
    CHECK_THROWS_WITH_AS(accel::copy_tensor_to_devices(r < 2 ? at::ones({2}) : at::Tensor()),
                         doctest::Contains("(processes 0 1 do)"), std::invalid_argument);
    CHECK(accel::all_reduce(1, accel::ReduceOp::SUM) == P);  // still in step afterwards
  }

  TEST_CASE("pad_across_processes: to the longest rank's size, at the end or at the start") {
    auto& d = world();
    const int P = d.get_world_size(), r = d.get_rank();
    at::Tensor x = at::arange(r == 0 ? P + 1 : P, at::kLong) + 1;
    at::Tensor end = accel::pad_across_processes(x, 0, -1);
    at::Tensor start = accel::pad_across_processes(x, 0, -1, /*pad_first=*/true);
    CHECK(end.size(0) == P + 1);
    CHECK(start.size(0) == P + 1);
    std::vector<int64_t> expected = range(1, P);
    if (r == 0) {
      CHECK(values(end) == range(1, P + 1));
    } else {
      auto at_end = expected;
      at_end.push_back(-1);
      CHECK(values(end) == at_end);
      expected.insert(expected.begin(), -1);
      CHECK(values(start) == expected);
    }
    // Nested, along a negative dim; a leaf with too few dimensions stays.
    std::vector<at::Tensor> nested{at::zeros({2, r + 1}), at::zeros({})};
    auto padded = accel::pad_across_processes(nested, -1);
    CHECK(shape(padded[0]) == std::vector<int64_t>{2, P});
    CHECK(padded[1].dim() == 0);
  }

  TEST_CASE("gather_object and broadcast_object_list") {
    auto& d = world();
    const int P = d.get_world_size(), r = d.get_rank();
    const auto ranks = range(0, P - 1);
    CHECK(accel::gather_object(std::vector<int>{r}) == std::vector<int>(ranks.begin(), ranks.end()));
    auto metrics = accel::gather_object(std::map<std::string, double>{{"accuracy", 0.5 + r}, {"f1", 1.0 * r}});
    REQUIRE(metrics.size() == static_cast<std::size_t>(P));
    CHECK(metrics.back().at("accuracy") == 0.5 + (P - 1));
    auto names = accel::gather_object(std::string(static_cast<std::size_t>(r) * 100, 'x'));  // lengths differ
    CHECK(names.back().size() == static_cast<std::size_t>(P - 1) * 100);

    std::vector<c10::IValue> config;
    if (r == 0) {
      c10::impl::GenericDict dict(c10::StringType::get(), c10::AnyType::get());
      dict.insert("lr", 0.001);
      config = {c10::IValue("run-7"), c10::IValue(int64_t{42}), c10::IValue(dict), c10::IValue(at::arange(3))};
    }
    accel::broadcast_object_list(config);
    REQUIRE(config.size() == 4);
    CHECK(config[0].toStringRef() == "run-7");
    CHECK(config[1].toInt() == 42);
    CHECK(config[2].toGenericDict().at("lr").toDouble() == 0.001);
    CHECK(values(config[3].toTensor()) == std::vector<int64_t>{0, 1, 2});
    std::vector<std::string> words{r == P - 1 ? "last" : "other"};
    CHECK(accel::broadcast_object_list(words, P - 1) == std::vector<std::string>{"last"});

    // Single objects of every leaf type the concept admits, one element per rank.
    CHECK(accel::gather_object(42) == std::vector<int>(static_cast<std::size_t>(P), 42));
    CHECK(accel::gather_object(3.5 + r).back() == 3.5 + (P - 1));
    const std::vector<bool> flags = accel::gather_object(r % 2 == 0);
    REQUIRE(flags.size() == static_cast<std::size_t>(P));
    for (int k = 0; k < P; ++k) CHECK(flags[static_cast<std::size_t>(k)] == (k % 2 == 0));
    const auto ivalues = accel::gather_object(c10::IValue(int64_t{r}));
    REQUIRE(ivalues.size() == static_cast<std::size_t>(P));
    CHECK(ivalues.back().toInt() == P - 1);
    const auto tensors = accel::gather_object(at::full({r + 1}, r, at::kLong));  // uneven shapes
    REQUIRE(tensors.size() == static_cast<std::size_t>(P));
    CHECK(values(tensors.back()) == std::vector<int64_t>(static_cast<std::size_t>(P), P - 1));
  }

  // Accelerate's test_script.py: test_split_between_processes_{list,nested_dict,tensor,evenly}.
  TEST_CASE("split_between_processes: Accelerate's list, nested dict, tensor and evenly cases") {
    auto& d = world();
    const int P = d.get_world_size(), r = d.get_rank();
    CHECK(accel::split_between_processes(range(0, 2 * P - 1)).size() == 2);
    for (int64_t n : {2 * P - 1, 2 * P}) {  // odd and even data, padded: gathered, the input comes first
      CAPTURE(n);
      const auto data = range(0, n - 1);
      const auto mine = accel::split_between_processes(data, /*apply_padding=*/true);
      CHECK(static_cast<int64_t>(mine.size()) == (n + P - 1) / P);
      auto gathered = accel::gather_object(mine);
      gathered.resize(static_cast<std::size_t>(n));
      CHECK(gathered == data);
      at::Tensor rows = accel::split_between_processes(at::arange(n).view({n, 1}), /*apply_padding=*/true);
      CHECK(rows.size(0) == (n + P - 1) / P);
      at::Tensor all = accel::gather(rows).flatten();
      CHECK(values(all.narrow(0, 0, n)) == data);
    }
    if (P > 1) {
      at::Tensor rows = accel::split_between_processes(at::arange(8).view({2, 4}));
      if (r == 0) CHECK(values(rows.flatten()) == range(0, 3));
      else if (r == 1) CHECK(values(rows.flatten()) == range(4, 7));
      else CHECK(rows.size(0) == 0);  // past the end: an empty share
    }
    if (P == 1 || P == 2 || P == 4) {
      std::map<std::string, std::vector<int64_t>> dict{{"a", range(1, 8)}, {"c", range(1, 8)}};
      auto part = accel::split_between_processes(dict);
      const auto per = static_cast<std::size_t>(8 / P);
      CHECK(part["a"] == std::vector<int64_t>(dict["a"].begin() + static_cast<std::ptrdiff_t>(per * r),
                                              dict["a"].begin() + static_cast<std::ptrdiff_t>(per * (r + 1))));
      std::map<std::string, at::Tensor> tensors{{"c", at::arange(1, 9)}};
      CHECK(values(accel::split_between_processes(tensors)["c"]) == part["c"]);
    }
    // 17 items: the first 17 % P processes get one more.
    const std::size_t per = static_cast<std::size_t>(17 / P), extras = static_cast<std::size_t>(17 % P);
    CHECK(accel::split_between_processes(range(0, 16)).size() == per + (static_cast<std::size_t>(r) < extras));
    // Padding repeats the last item of the whole input (Accelerate: rank 1 of
    // 4 gets 5, 6, 7, 8, 16), an empty share included.
    const auto padded = accel::split_between_processes(range(0, 16), /*apply_padding=*/true);
    CHECK(padded.size() == per + (extras > 0));
    if (static_cast<std::size_t>(r) >= extras && extras > 0) CHECK(padded.back() == 16);
    if (P == 4 && r == 1) CHECK(padded == std::vector<int64_t>{5, 6, 7, 8, 16});
    at::Tensor padded_rows = accel::split_between_processes(at::arange(17), /*apply_padding=*/true);
    CHECK(values(padded_rows) == padded);
    if (P > 2) {  // 2 items on 3 or 4 processes: the last ones get nothing, or the last item padded
      CHECK(accel::split_between_processes(range(0, 1)).size() == (r < 2 ? 1u : 0u));
      CHECK(accel::split_between_processes(range(0, 1), true) == std::vector<int64_t>{r < 2 ? r : 1});
    }
  }

  TEST_CASE("split_between_processes: 17 and 8 items on this world, vectors, tensors, maps, padding") {
    auto& d = world();
    const int P = d.get_world_size();
    for (int64_t n : {17, 8}) {
      CAPTURE(n);
      auto mine = accel::split_between_processes(range(0, n - 1));
      // Every rank's share, concatenated in rank order, is the input.
      CHECK(accel::gather_object(mine) == range(0, n - 1));
      const auto lengths = accel::all_gather(static_cast<int64_t>(mine.size()));
      CHECK(lengths.front() == (n + P - 1) / P);
      CHECK(lengths.back() == n / P);
      at::Tensor rows = accel::split_between_processes(at::arange(n).view({n, 1}));
      CHECK(values(rows.flatten()) == mine);
      std::map<std::string, std::vector<int64_t>> columns{{"a", range(0, n - 1)}, {"b", range(100, 100 + n - 1)}};
      auto part = accel::split_between_processes(columns);
      CHECK(part["a"] == mine);
      CHECK(part["b"].front() == 100 + mine.front());
      auto padded = accel::split_between_processes(range(0, n - 1), /*apply_padding=*/true);
      CHECK(static_cast<int64_t>(padded.size()) == lengths.front());
      CHECK(padded.back() == (mine.size() < padded.size() ? n - 1 : mine.back()));
      CHECK(accel::split_between_processes(at::arange(n), true).size(0) == lengths.front());
    }
    std::map<std::string, std::vector<int>> ragged{{"a", {1, 2}}, {"b", {1}}};
    CHECK_THROWS_WITH_AS(accel::split_between_processes(ragged), doctest::Contains("same length"),
                         std::invalid_argument);
  }

  TEST_CASE("set_seed and synchronize_rng_states") {
    auto& d = world();
    const int P = d.get_world_size();
    CHECK(accel::set_seed(42, /*device_specific=*/true) == 42u + static_cast<unsigned>(d.get_rank()));
    const double own = at::rand({1}).item<double>();
    const auto draws = accel::all_gather(own);
    if (P > 1) CHECK(draws[0] != draws[1]);  // device-specific streams differ
    accel::synchronize_rng_states();
    const auto synced = accel::all_gather(at::rand({1}).item<double>());
    CHECK(std::all_of(synced.begin(), synced.end(), [&](double x) { return x == synced[0]; }));
    at::Generator mine = at::detail::createCPUGenerator(1000 + d.get_rank());
    accel::synchronize_rng_states({"generator"}, mine);
    const auto from_generator = accel::all_gather(at::rand({1}, mine).item<double>());
    CHECK(std::all_of(from_generator.begin(), from_generator.end(), [&](double x) { return x == from_generator[0]; }));
    CHECK_THROWS_WITH_AS(accel::synchronize_rng_states({"xla"}), doctest::Contains("unknown rng type 'xla'"),
                         std::invalid_argument);
    if (accel::is_torch_cuda_available()) CHECK_NOTHROW(accel::synchronize_rng_states({"cuda"}));
    else CHECK_THROWS_AS(accel::synchronize_rng_states({"cuda"}), std::invalid_argument);  // no GPU
  }

  TEST_CASE("wait_for_everyone, print and the on_*_process wrappers") {
    auto& d = world();
    const int P = d.get_world_size(), r = d.get_rank();
    accel::wait_for_everyone();
    auto on_main = accel::on_main_process([](int x) { return x * 2; });
    auto on_last = accel::on_last_process([&] { return r; });
    int local_calls = 0;
    accel::on_local_main_process([&] { ++local_calls; })();
    CHECK(on_main(21) == (r == 0 ? std::optional<int>(42) : std::nullopt));
    CHECK(on_last() == (r == P - 1 ? std::optional<int>(P - 1) : std::nullopt));
    CHECK(local_calls == (d.get_local_rank() == 0 ? 1 : 0));
    CHECK(accel::all_reduce(int64_t{local_calls}, ReduceOp::SUM) == P / d.get_local_world_size());
    accel::print("accel::print from the main process only; world size", P);
    CHECK(accel::local_main_process_first([&] { return r; }) == r);
  }

  TEST_CASE("debug mode: a 2-D tensor on rank 0 and 3-D elsewhere throws the same text on every rank") {
    auto& d = world();
    const int P = d.get_world_size(), r = d.get_rank();
    accel::set_debug_mode(true);
    at::Tensor t = r == 0 ? at::ones({2, 3}) : at::ones({2, 3, 4});
    struct Case {
      std::string name;
      std::function<void()> call;
      std::string rank0;
      std::string rank1;
    };
    at::Tensor split = r == 0 ? at::ones({2 * P, 3}) : at::ones({2 * P, 3, 4});
    const std::string rows = std::to_string(2 * P);
    const std::vector<Case> cases{
        {"gather", [&] { accel::gather(t); }, "rank 0: gather(Float[*, 3] cpu)", "rank 1: gather(Float[*, 3, 4] cpu)"},
        {"reduce", [&] { accel::reduce(t, "sum"); }, "rank 0: reduce(Float[2, 3] cpu, sum)",
         "rank 1: reduce(Float[2, 3, 4] cpu, sum)"},
        {"broadcast", [&] { accel::broadcast(std::vector<at::Tensor>{t}); },
         "rank 0: broadcast([Float[2, 3] cpu], src=0)", "rank 1: broadcast([Float[2, 3, 4] cpu], src=0)"},
        {"pad_across_processes", [&] { accel::pad_across_processes(t); },
         "rank 0: pad_across_processes(Float[*, 3] cpu, dim=0",
         "rank 1: pad_across_processes(Float[*, 3, 4] cpu, dim=0"},
        {"all_reduce", [&] { accel::all_reduce(std::vector<double>(r == 0 ? 3 : 4, 1.0)); },
         "rank 0: all_reduce(vector<float64>[3], mean)", "rank 1: all_reduce(vector<float64>[4], mean)"},
        {"reduce_scatter", [&] { accel::reduce_scatter(split); },
         "rank 0: reduce_scatter(Float[" + rows + ", 3] cpu, sum)",
         "rank 1: reduce_scatter(Float[" + rows + ", 3, 4] cpu, sum)"},
        {"all_to_all", [&] { accel::all_to_all(split); }, "rank 0: all_to_all(Float[" + rows + ", 3] cpu)",
         "rank 1: all_to_all(Float[" + rows + ", 3, 4] cpu)"},
        {"uneven all_to_all", [&] { accel::all_to_all(split, {}, {}); },
         "rank 0: all_to_all(Float[*, 3] cpu, split sizes)", "rank 1: all_to_all(Float[*, 3, 4] cpu, split sizes)"},
        {"reduce_to", [&] { accel::reduce_to(t, 0); }, "rank 0: reduce_to(Float[2, 3] cpu, dst=0, sum)",
         "rank 1: reduce_to(Float[2, 3, 4] cpu, dst=0, sum)"},
        {"gather_to", [&] { accel::gather_to(t, 0); }, "rank 0: gather_to(Float[2, 3] cpu, dst=0)",
         "rank 1: gather_to(Float[2, 3, 4] cpu, dst=0)"},
        {"scatter",
         [&] {
           if (r == 0) accel::scatter(std::vector<int>(P, 1), 0);
           else accel::scatter(std::vector<double>{}, 0);
         },
         "rank 0: scatter(int32, src=0)", "rank 1: scatter(float64, src=0)"},
        {"monitored_barrier",
         [&] {
           if (r == 0) accel::monitored_barrier();
           else accel::barrier();
         },
         "rank 0: monitored_barrier()", "rank 1: barrier()"},
    };
    for (const auto& c : cases) {
      CAPTURE(c.name);
      const auto started = std::chrono::steady_clock::now();
      const std::string text = what_of(c.call);
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
      if (P == 1) {
        CHECK(text == "<no exception>");
        continue;
      }
      CHECK(text.find("[ACCEL_DEBUG_MODE]") != std::string::npos);
      CHECK(text.find(c.rank0) != std::string::npos);
      CHECK(text.find(c.rank1) != std::string::npos);
      CHECK(text.find("rank " + std::to_string(P - 1) + ":") != std::string::npos);
      // Every rank threw the very same text (this all_gather is checked too).
      const auto hashes = accel::all_gather(text_hash(text));
      CHECK(std::all_of(hashes.begin(), hashes.end(), [&](int64_t h) { return h == hashes[0]; }));
      if (r == 0) MESSAGE(c.name << ": every rank threw after " << seconds << " s:\n" << text);
    }
    // Different operations on different ranks are named as such.
    if (P > 1) {
      const std::string text = what_of([&] {
        if (r == 0) accel::gather(at::ones({2}));
        else accel::reduce(at::ones({2}), "sum");
      });
      CHECK(text.find("rank 0: gather(Float[*] cpu)") != std::string::npos);
      CHECK(text.find("rank 1: reduce(Float[2] cpu, sum)") != std::string::npos);
    }
    // Split sizes that disagree between ranks: named, on every rank (rank 0 expects one row too many from rank 1).
    if (P > 1) {
      std::vector<int64_t> equal(P, 1), expects(P, 1);
      if (r == 0) expects[1] = 2;
      const std::string text = what_of([&] { accel::all_to_all(at::ones({P}), expects, equal); });
      CHECK(text.find("rank 1 sends 1 rows to rank 0, which expects 2") != std::string::npos);
      const auto hashes = accel::all_gather(text_hash(text));
      CHECK(std::all_of(hashes.begin(), hashes.end(), [&](int64_t h) { return h == hashes[0]; }));
    }
    // Matching calls go through, and the group is still in step.
    CHECK(accel::reduce(at::ones({2}), "sum")[0].item<double>() == P);
    accel::set_debug_mode(false);
  }

  TEST_CASE("operations cleanup") { release_world(); }
}

// == mesh4: the operations on one mesh dimension's group ======================

TEST_SUITE("mesh4") {
  TEST_CASE("gather, reduce, broadcast and gather_object on the dp group of a (2, 2) data mesh") {
    auto& d = fresh({.cp_size = 2});
    const int r = d.get_rank(), cp = r % 2;
    const std::vector<int64_t> members{cp, 2 + cp};  // same cp coordinate
    const auto& dp = d.get_group(Dim::DP);
    CHECK(values(accel::gather(longs({r}), dp)) == members);
    CHECK(accel::reduce(longs({r}), "sum", dp)[0].item<int64_t>() == members[0] + members[1]);
    std::vector<at::Tensor> state{longs({r}), at::full({1}, r, at::kDouble)};
    accel::broadcast(state, 1, dp);
    CHECK(values(state[0]) == std::vector<int64_t>{members[1]});
    CHECK(values(state[1]) == std::vector<int64_t>{members[1]});
    CHECK(accel::gather_object(std::vector<int64_t>{r}, dp) == members);
    CHECK(accel::split_between_processes(range(0, 16), false, dp).front() == (d.get_rank(Dim::DP) == 0 ? 0 : 9));
    d.destroy();
  }

  TEST_CASE("the second-wave collectives on the dp group of a (2, 2) data mesh: roots are ranks within the group") {
    auto& d = fresh({.cp_size = 2});
    const int r = d.get_rank(), cp = r % 2, me = d.get_rank(Dim::DP);  // members: cp and 2 + cp
    REQUIRE(me == r / 2);
    const auto& dp = d.get_group(Dim::DP);
    // Rank r holds [r, r, 10 r, 10 r]; group rank k gets rows 2k, 2k+1 summed over cp and 2 + cp.
    const at::Tensor x = at::tensor({r, r, 10 * r, 10 * r}, at::kLong);
    const int64_t sum = cp + 2 + cp;
    CHECK(values(accel::reduce_scatter(x, ReduceOp::SUM, dp)) ==
          (me == 0 ? std::vector<int64_t>{sum, sum} : std::vector<int64_t>{10 * sum, 10 * sum}));
    CHECK(values(accel::all_to_all(x, dp)) ==
          (me == 0 ? std::vector<int64_t>{cp, cp, 2 + cp, 2 + cp}
                   : std::vector<int64_t>{10 * cp, 10 * cp, 10 * (2 + cp), 10 * (2 + cp)}));
    const int64_t reduced = accel::reduce_to(int64_t{r}, 1, ReduceOp::SUM, dp);  // dst 1: global rank 2 + cp
    if (me == 1) CHECK(reduced == sum);
    const auto gathered = accel::gather_to(int64_t{r}, 1, dp);
    CHECK(gathered == (me == 1 ? std::vector<int64_t>{cp, 2 + cp} : std::vector<int64_t>{}));
    const std::vector<int64_t> parts = me == 1 ? std::vector<int64_t>{100 + cp, 200 + cp} : std::vector<int64_t>{};
    CHECK(accel::scatter(parts, 1, dp) == (me == 0 ? 100 + cp : 200 + cp));
    if (me == 0) accel::send(int64_t{r}, 1, dp);
    else CHECK(accel::recv(int64_t{-1}, 0, dp) == cp);
    CHECK_NOTHROW(accel::monitored_barrier(dp));
    CHECK_THROWS_WITH_AS(accel::reduce_to(1, 2, ReduceOp::SUM, dp), doctest::Contains("is not a rank of group"),
                         std::invalid_argument);
    d.destroy();
  }
}
