"""The engine under the public modules. Its layers and modules are in docs/ARCHITECTURE.md
("Layout and layers"), which `lint-imports` enforces."""
