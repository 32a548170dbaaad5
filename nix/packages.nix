# The `packages` output of one system, from the overlay's scope: every value is a derivation.
# The default vLLM release's packages have plain names; each other release (scope.releases)
# adds its environment, vLLM, closure and the apps that run its vLLM with the release suffix
# (`vllm-env_0_33`, `serve-flash-next_0_33`).
{ scope }:
let
  inherit (scope) magpieLib;
  releasePackages =
    release:
    let
      releaseScope = scope.releases.${release};
    in
    magpieLib.suffixNames releaseScope.releaseSuffix (
      {
        vllm-env = releaseScope.env;
        vllm = releaseScope.vllm;
        vllm-wheel-closure = releaseScope.wheelClosure;
      }
      // builtins.intersectAttrs magpieLib.releaseApps releaseScope.apps
    );
in
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
// builtins.foldl' (all: release: all // releasePackages release) { } magpieLib.otherVllmReleases
