"""What a built model repository is: the builder↔runtime contract (``contract``), who calls whom
(``ensemble_graph``), which backends can load it (``backends``). Imports only the package's base
modules."""
