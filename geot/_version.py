# The one place geot's version is set: pyproject.toml reads it for the package
# metadata, geot.__version__ imports it.
__version__ = "0.1.0"
