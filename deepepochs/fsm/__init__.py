"""The loop machine: typed spec records, code generation, generated tables, runtime and rendering."""
