# The `packages` output of one system, from the overlay's scope: every value is a derivation.
{ scope }:
{
  default = scope.env;
  vllm-env = scope.env;
  vllm-env-flashinfer-aot = scope.envWithFlashinferAot;
  vllm = scope.vllm;
  vllm-wheel-closure = scope.wheelClosure;
  flashinfer-jit-cache = scope.flashinferJitCache;
  cuda-home = scope.cudaHome;
  nvidia-driver-libs = scope.nvidiaDriverLibs;
}
// scope.apps
