// What a user's translation unit instantiates, compiled with the project's
// compiler at -O3 (CMake's Release) and -Wall -Wextra -Werror, and
// without the -Wno-missing-field-initializers the test sources need: the
// training example (Accelerator, DataParallel, loaders, checkpoints,
// safetensors weights), the
// autograd-aware collectives, an N-D mesh, and every public configuration
// struct built with designated initializers that leave members out (GCC 14
// warns for a left-out member that has no initializer of its own). Middle-end
// warnings (-Warray-bounds, -Wstringop-overflow) need code generation, so
// this is compiled, not only parsed. Built by the CTest entry werror_user_tu.
#include "../examples/train_mlp.cpp"

accel::DistributedConfig probe_distributed() { return {.cp_size = 2}; }
accel::AcceleratorConfig probe_accelerator() { return {.gradient_accumulation_steps = 2}; }
accel::ProjectConfiguration probe_project() { return {.automatic_checkpoint_naming = true}; }
accel::DataLoaderConfig probe_loader() { return {.batch_size = 8}; }
accel::LaunchOptions probe_launch() { return {.prefix_output = false}; }

at::Tensor probe_autograd(const at::Tensor& x, const accel::GroupPtr& group) {
  return accel::autograd::all_reduce(x, accel::ReduceOp::SUM, group) + accel::autograd::all_gather(x, group).sum() +
         accel::autograd::reduce_scatter(x, accel::ReduceOp::MEAN, group).sum() + accel::autograd::all_to_all(x).sum();
}

int probe_mesh() {
  accel::DeviceMesh mesh = accel::init_device_mesh({1, 1}, {"dp", "cp"});
  return mesh.slice("dp", "cp").flatten().size() + mesh.slice("dp_cp").get_local_rank();
}

void probe_weights(accel::Accelerator& accelerator, torch::nn::Linear& model) {
  accelerator.save_model(model, "weights", 1 << 20);
  accelerator.load_model(model, "weights");
}
