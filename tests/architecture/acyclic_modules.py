"""An import-linter contract type: no circle of imports between two modules of the named packages.

import-linter's own contracts see packages. A layers contract keeps `entrypoints` above
`engine` but says nothing of two modules of one layer importing each other
(`entrypoints/api_server.py` <-> `entrypoints/serve_args.py`), and `acyclic_siblings` takes a
subpackage with everything in it as one node. Here every module is a node and every direct
import an edge, TYPE_CHECKING ones included (the graph lint-imports builds has them), and each
strongly connected component is reported as its shortest circle, with the import lines.
Registered in pyproject.toml's [tool.importlinter] `contract_types`, so `lint-imports` checks it
with the other contracts, on the one graph it builds.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import cast

import grimp
from importlinter.application import output
from importlinter.domain import fields
from importlinter.domain.contract import Contract, ContractCheck, InvalidContractOptions


@dataclass(frozen=True)
class Link:
    importer: str
    imported: str
    line_numbers: tuple[int, ...]


@dataclass(frozen=True)
class Circle:
    links: tuple[Link, ...]  # the shortest circle through the component's first module
    component: tuple[str, ...]  # every module on some circle with those

    def chain(self) -> str:
        return " -> ".join([link.importer for link in self.links] + [self.links[0].importer])


class AcyclicModulesContract(Contract):
    type_name = "acyclic_modules"

    packages = fields.ListField(subfield=fields.StringField())

    def check(self, graph: grimp.ImportGraph, verbose: bool) -> ContractCheck:
        modules = modules_of(graph, cast(list[str], self.packages))
        circles = [circle_of(graph, component) for component in import_circles(graph, modules)]
        return ContractCheck(kept=not circles, metadata={"circles": circles})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for circle in cast(list[Circle], check.metadata["circles"]):
            output.print_error(circle.chain())
            output.new_line()
            for link in circle.links:
                lines = ", ".join(f"l.{number}" for number in link.line_numbers)
                output.indent_cursor()
                output.print_error(f"- {link.importer} -> {link.imported} ({lines})", bold=False)
            others = sorted(set(circle.component) - {link.importer for link in circle.links})
            if others:
                output.indent_cursor()
                output.print(f"(in the same circles: {', '.join(others)})")
            output.new_line()


def modules_of(graph: grimp.ImportGraph, packages: list[str]) -> set[str]:
    missing = [package for package in packages if package not in graph.modules]
    if missing:
        raise InvalidContractOptions({"packages": f"Not in the import graph: {', '.join(missing)}."})
    return {module for package in packages for module in graph.find_descendants(package) | {package}}


def import_circles(graph: grimp.ImportGraph, modules: set[str]) -> list[tuple[str, ...]]:
    """The strongly connected components of more than one module, each as its sorted module names.

    A module's component is what it imports (directly or not) that also imports it back."""
    components: list[tuple[str, ...]] = []
    placed: set[str] = set()
    for module in sorted(modules):
        if module in placed:
            continue
        component = graph.find_upstream_modules(module) & graph.find_downstream_modules(module)
        placed |= component | {module}
        if component:
            components.append(tuple(sorted(component | {module})))
    return components


def circle_of(graph: grimp.ImportGraph, component: tuple[str, ...]) -> Circle:
    """The shortest circle through the component's first module (any path back stays inside)."""
    start = component[0]
    returns = [
        graph.find_shortest_chain(importer=imported, imported=start)
        for imported in sorted(graph.find_modules_directly_imported_by(start) & set(component))
    ]
    path = (start, *min((chain for chain in returns if chain), key=len))
    links = tuple(link_of(graph, importer, imported) for importer, imported in itertools.pairwise(path))
    return Circle(links=links, component=component)


def link_of(graph: grimp.ImportGraph, importer: str, imported: str) -> Link:
    details = graph.get_import_details(importer=importer, imported=imported)
    numbers = tuple(sorted({detail["line_number"] for detail in details}))
    return Link(importer=importer, imported=imported, line_numbers=numbers)
