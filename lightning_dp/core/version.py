"""The package version, in a module of its own so that the report and the build read it without cycles."""

__version__ = "0.1.0"
