// Each ACCEL_CASE_* except ACCEL_CASE_OK is a use of accel.hpp that must not
// compile; tests/CMakeLists.txt checks that the compiler rejects it through
// the concept it breaks (TensorLike, TensorTree or Picklable).
#include "accel.hpp"

#include <map>
#include <string>

void use() {
#if defined(ACCEL_CASE_OK)
  (void)accel::all_reduce(1.0);
  (void)accel::all_gather(std::vector<int>{1});
  (void)accel::broadcast(std::vector<float>{1.0f});
  (void)accel::gather(std::vector<at::Tensor>{});
  (void)accel::reduce(std::map<std::string, at::Tensor>{}, "sum");
  (void)accel::gather_object(std::map<std::string, std::vector<int>>{});
#elif defined(ACCEL_CASE_STRING)
  (void)accel::all_reduce(std::string("text"));
#elif defined(ACCEL_CASE_BOOL)
  (void)accel::all_reduce(true);
#elif defined(ACCEL_CASE_VECTOR_BOOL)
  (void)accel::all_reduce(std::vector<bool>{true, false});
#elif defined(ACCEL_CASE_CSTRING)
  (void)accel::broadcast("text");
#elif defined(ACCEL_CASE_GATHER_MAP)
  (void)accel::all_gather(std::map<std::string, float>{});
#elif defined(ACCEL_CASE_GATHER_FLOATS)
  (void)accel::gather(std::vector<float>{1.0f});  // not tensors: use all_gather
#elif defined(ACCEL_CASE_REDUCE_MIXED)
  (void)accel::reduce(std::tuple<at::Tensor, int>{}, "sum");  // a leaf that is not a tensor
#elif defined(ACCEL_CASE_OBJECT_POINTER)
  int x = 0;
  (void)accel::gather_object(&x);  // a pointer cannot travel
#else
#error "define one ACCEL_CASE_*"
#endif
}
