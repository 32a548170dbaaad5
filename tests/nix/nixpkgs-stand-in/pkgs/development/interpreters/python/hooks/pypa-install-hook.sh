# shellcheck shell=bash disable=SC2154  # $out: the output path Nix sets
# The stand-in's pypaInstallHook, with the behaviour of nixpkgs'
# (pkgs/development/interpreters/python/hooks/pypa-install-hook.sh): the install phase, unless
# the derivation has its own, runs pypa/installer on the bare interpreter once per wheel in
# dist/, each into the same prefix $out, between the preInstall and postInstall hooks. installer
# refuses to overwrite a file an earlier wheel wrote, so a path two wheels ship fails the build.
# tests/nix/test_wheel_install.py sources this, @pythonInterpreter@ substituted, in the
# emulated build sandbox.
echo "Sourcing pypa-install-hook (stand-in)"

pypaInstallPhase() {
    echo "Executing pypaInstallPhase"
    runHook preInstall
    pushd dist >/dev/null || return 1
    local wheel
    for wheel in *.whl; do
        @pythonInterpreter@ -m installer --prefix "$out" "$wheel"
        echo "Successfully installed $wheel"
    done
    popd >/dev/null || return 1
    export PYTHONPATH="$out/@pythonSitePackages@${PYTHONPATH:+:$PYTHONPATH}"
    runHook postInstall
    echo "Finished executing pypaInstallPhase"
}

if [ -z "${dontUsePypaInstall-}" ] && [ -z "${installPhase-}" ]; then
    installPhase=pypaInstallPhase
fi
