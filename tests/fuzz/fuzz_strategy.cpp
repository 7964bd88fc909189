// libFuzzer: DistributedStrategy validation over arbitrary sizes. The input
// is read as int32 values: world, mp_replicate, mp_shard, dp, cp, a byte of
// flags saying which optional sizes are given, then tp and pp as signed
// bytes (1 when the input ends before them). An accepted strategy must tile
// the world in both meshes, tp and pp included; a rejected one must say why
// with std::invalid_argument.
#include "accel.hpp"

#include <cstdlib>
#include <cstring>
#include <string_view>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  int32_t v[5] = {1, 1, 1, 1, 1};
  std::memcpy(v, data, std::min(size, sizeof v));
  const uint8_t flags = size > sizeof v ? data[sizeof v] : 0;
  accel::DistributedConfig config;
  config.mp_replicate_size = v[1];
  if (flags & 1) config.mp_shard_size = v[2];
  if (flags & 2) config.dp_size = v[3];
  config.cp_size = v[4];
  config.tp_size = size > sizeof v + 1 ? static_cast<int8_t>(data[sizeof v + 1]) : 1;
  config.pp_size = size > sizeof v + 2 ? static_cast<int8_t>(data[sizeof v + 2]) : 1;
  try {
    accel::DistributedStrategy s(config, v[0]);
    auto [rep, shard] = s.model_mesh_shape();
    auto [dp, cp] = s.data_mesh_shape();
    if (rep < 1 || shard < 1 || dp < 1 || cp < 1) std::abort();
    if (s.tp_size() != config.tp_size || s.pp_size() != config.pp_size) std::abort();
    const int64_t outer = static_cast<int64_t>(s.tp_size()) * s.pp_size();
    if (static_cast<int64_t>(rep) * shard * outer != v[0] || static_cast<int64_t>(dp) * cp * outer != v[0])
      std::abort();
    if (rep != v[1] || cp != v[4]) std::abort();
    if ((flags & 1) && shard != v[2]) std::abort();
    if ((flags & 2) && dp != v[3]) std::abort();
  } catch (const std::invalid_argument& e) {
    if (std::string_view(e.what()).rfind("accel::DistributedStrategy: ", 0) != 0) std::abort();
  }
  return 0;
}
