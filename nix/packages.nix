# The `packages` output of one system, from the overlay's scope.
{ pkgs }:
let
  scope = pkgs.magpie-vllm-plugins;
in
{
  default = scope.env;
  vllm-env = scope.env;
  vllm = scope.vllm;
  vllm-wheel-closure = scope.wheelClosure;
  flashinfer-jit-cache = scope.flashinferJitCache;
  cuda-home = scope.cudaHome;
  nvidia-driver-libs = scope.nvidiaDriverLibs;
}
// scope.apps
