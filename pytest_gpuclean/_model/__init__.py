"""The model: the records that flow through the package, and the decisions over a test's record."""

