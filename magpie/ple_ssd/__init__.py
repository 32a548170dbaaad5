"""Tools of the ple_ssd optimization: the staging benchmark."""
