// Uses of accel.hpp that must not compile. Each line marked `// must fail:
// CONCEPT` is one case: tests/compile_fail.sh compiles the file once and
// checks that the compiler rejects every marked line, each through the concept
// it breaks (TensorLike, TensorTree or Picklable), and nothing else. Each case
// sits in a function of its own, so that one rejected call does not hide the
// next from the compiler. ACCEL_CASE_OK is the positive control: the same
// calls with supported types, which must compile.
#include "accel.hpp"

#include <map>
#include <string>

#if defined(ACCEL_CASE_OK)
void use() {
  (void)accel::all_reduce(1.0);
  (void)accel::all_gather(std::vector<int>{1});
  (void)accel::broadcast(std::vector<float>{1.0f});
  (void)accel::gather(std::vector<at::Tensor>{});
  (void)accel::reduce(std::map<std::string, at::Tensor>{}, "sum");
  (void)accel::gather_object(std::map<std::string, std::vector<int>>{});
}
#else
void use_string() { (void)accel::all_reduce(std::string("text")); }                  // must fail: TensorLike
void use_bool() { (void)accel::all_reduce(true); }                                   // must fail: TensorLike
void use_vector_bool() { (void)accel::all_reduce(std::vector<bool>{true, false}); }  // must fail: TensorLike
void use_cstring() { (void)accel::broadcast("text"); }                               // must fail: TensorLike
void use_gather_map() { (void)accel::all_gather(std::map<std::string, float>{}); }   // must fail: TensorLike
// Not tensors: use all_gather.
void use_gather_floats() { (void)accel::gather(std::vector<float>{1.0f}); }  // must fail: TensorTree
// A leaf that is not a tensor.
void use_reduce_mixed() { (void)accel::reduce(std::tuple<at::Tensor, int>{}, "sum"); }  // must fail: TensorTree
// A pointer cannot travel.
void use_object_pointer() {
  int x = 0;
  (void)accel::gather_object(&x);  // must fail: Picklable
}
#endif
