# The shape of nixpkgs' mirror list (a plain attribute set of URL lists), with a placeholder host.
{
  pypi = [ "https://registry.invalid/packages/source/" ];
}
