"""Hazard 33: a file's DWARF names frames (symbols/lines.py), and the file is the program's to
make. A DIE tree deeper than a lookup goes and sibling links that go back are read within
bounds: the line is found, no inlined function is made up, and nothing raises or loops."""

from __future__ import annotations

import subprocess
from pathlib import Path

from elftools.elf.elffile import ELFFile

from dynprobe.symbols.lines import inlined_at, source_line

DEPTH = 3000  # nested blocks, each with a variable of its own: a lexical block DIE each


def compile_c(tmp_path: Path, source: str) -> Path:
    (tmp_path / "hostile.c").write_text(source)
    binary = tmp_path / "hostile"
    subprocess.run(["gcc", "-g", "-O0", "-o", str(binary), str(tmp_path / "hostile.c")], check=True)
    return binary


def low_pc(binary: Path, function: str) -> int:
    with open(binary, "rb") as f:
        for cu in ELFFile(f).get_dwarf_info().iter_CUs():
            for die in cu.iter_DIEs():
                name = die.attributes.get("DW_AT_name")
                if die.tag == "DW_TAG_subprogram" and name is not None and name.value == function.encode():
                    return int(die.attributes["DW_AT_low_pc"].value)
    raise AssertionError(f"no {function}")


def test_a_die_tree_deeper_than_a_lookup_goes(tmp_path: Path) -> None:
    opening = "".join(f"{{ volatile int v{i} = {'x' if i == 0 else f'v{i - 1}'};\n" for i in range(DEPTH))
    closing = "}" * DEPTH
    source = f"int deep(int x) {{\n{opening} x = v{DEPTH - 1};\n{closing}\nreturn x; }}\n"
    source += "int main(void) { return deep(1); }\n"
    binary = compile_c(tmp_path, source)
    with open(binary, "rb") as f:
        dwarf = ELFFile(f).get_dwarf_info()
        lines = [entry.state for cu in dwarf.iter_CUs()
                 for entry in dwarf.line_program_for_CU(cu).get_entries() if entry.state is not None]  # fmt: skip
    innermost = next(s.address for s in lines if s.line == DEPTH + 2)  # `x = v199;`
    assert source_line(str(binary), innermost) == f"hostile.c:{DEPTH + 2}"
    assert inlined_at(str(binary), innermost) == ()


def test_sibling_links_that_go_back(tmp_path: Path) -> None:
    """Every DW_AT_sibling of the unit pointed back at the unit's first child: a walk of the
    children would go round for ever."""
    source = "struct s { int a; int b; };\nint f(struct s *p) {\n  return p->a + p->b;\n}\n"
    source += "int main(void) {\n  struct s v = {1, 2};\n  return f(&v);\n}\n"
    binary = compile_c(tmp_path, source)
    data = bytearray(binary.read_bytes())
    with open(binary, "rb") as f:
        elf = ELFFile(f)
        info = elf.get_section_by_name(".debug_info")
        patched = 0
        for cu in elf.get_dwarf_info().iter_CUs():
            first_child = next(cu.get_top_DIE().iter_children())
            for die in cu.iter_DIEs():
                sibling = die.attributes.get("DW_AT_sibling")
                if sibling is not None and sibling.form == "DW_FORM_ref4":
                    at = info["sh_offset"] + sibling.offset
                    data[at : at + 4] = (first_child.offset - cu.cu_offset).to_bytes(4, "little")
                    patched += 1
    assert patched
    main = low_pc(binary, "main")
    binary.write_bytes(data)
    assert source_line(str(binary), main) == "hostile.c:5"
    assert inlined_at(str(binary), main) == ()
