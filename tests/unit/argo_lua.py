"""Run an Argo CD health script in lupa with only the Lua globals Argo CD gives it.

lupa opens every Lua standard library; Argo CD does not. A health script from argocd-cm runs with
useOpenLibs off unless ``resource.customizations.useOpenLibs.<group>_<kind>`` is set, and the chart
sets none. What such a script gets, read from the sources (issue 42):

- Argo CD v3.2.12, util/lua/lua.go, ``runLuaWithResourceActionParameters``:
  ``lua.NewState(lua.Options{SkipOpenLibs: !vm.UseOpenLibs})``, then it calls OpenPackage, OpenBase,
  OpenTable and its own OpenSafeOs, preloads SafeOsLoader as module "os", and sets the globals
  ``actionParams`` (an empty table for a health check) and ``obj``.
- gopher-lua v1.1.1 (Argo CD v3.2.12's go.mod): ``NewState`` calls ``OpenLibs`` only when
  SkipOpenLibs is false (state.go), so string, math, io, os, debug, coroutine and channel are not
  opened. Strings get a metatable only in ``OpenString`` (stringlib.go: ``builtinMts[LTString]``),
  so ``("x"):find(...)`` fails like ``string.find`` does.
- OpenSafeOs (oslib_safe.go) calls ``RegisterModule("table", {time, date})``; the "table" module
  is already loaded by OpenTable, so gopher-lua's RegisterModule (auxlib.go) returns it unchanged:
  there is no ``os`` global, and ``table`` keeps only its own functions. ``require("os")`` returns
  ``{time, date}`` through package.preload.

Lupa's Lua 5.1 is PUC Lua, not gopher-lua: the names only gopher-lua has (``_GOPHER_LUA_VERSION``,
``_printregs``) are not emulated, nor Argo CD's one-second timeout. Under lupa's Lua 5.4 the same
allow-list leaves a subset (5.4 lacks ``unpack``, ``getfenv``, ...), which is still a fair check
that a script runs there too.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from lupa import lua51

ARGO_CD_VERSION = "v3.2.12"
GOPHER_LUA_VERSION = "v1.1.1"

BASE_GLOBALS = frozenset({
    # gopher-lua baselib.go OpenBase: these three, baseFuncs, and ipairs/pairs.
    "_G", "_VERSION", "_GOPHER_LUA_VERSION",
    "assert", "collectgarbage", "dofile", "error", "getfenv", "getmetatable", "load", "loadfile",
    "loadstring", "next", "pcall", "print", "rawequal", "rawget", "rawset", "select", "_printregs",
    "setfenv", "setmetatable", "tonumber", "tostring", "type", "unpack", "xpcall", "module",
    "require", "newproxy", "ipairs", "pairs",
})
ARGO_GLOBALS = BASE_GLOBALS | {"package", "table", "actionParams", "obj"}
"""Every global a health script can read in Argo CD with useOpenLibs off."""

TABLE_FUNCTIONS = frozenset({"concat", "getn", "insert", "maxn", "remove", "sort"})  # tablelib.go
PACKAGE_FIELDS = frozenset({"config", "cpath", "loaded", "loaders", "loadlib", "path", "preload",  # loadlib.go
                            "seeall"})
SAFE_OS_FUNCTIONS = frozenset({"date", "time"})  # oslib_safe.go osFuncs, only through require("os")
STRING_FUNCTIONS = frozenset({"byte", "char", "dump", "find", "format", "gfind", "gmatch", "gsub", "len",
                              "lower", "match", "rep", "reverse", "sub", "upper"})
"""Lua 5.1's string library: a method call with one of these names is a string method, which
fails in Argo CD (strings have no metatable there)."""

_RESTRICT = """
local keep_globals, keep_table, keep_package, keep_os = ...
local os_funcs = {}
for name in pairs(keep_os) do os_funcs[name] = os[name] end
-- gopher-lua gives strings a metatable only in OpenString, which Argo CD does not call.
debug.setmetatable("", nil)
for name in pairs(_G) do
  if not keep_globals[name] then _G[name] = nil end
end
for name in pairs(table) do
  if not keep_table[name] then table[name] = nil end
end
for name in pairs(package) do
  if not keep_package[name] then package[name] = nil end
end
for name in pairs(package.loaded) do
  if name ~= "_G" and name ~= "table" then package.loaded[name] = nil end
end
for name in pairs(package.preload) do package.preload[name] = nil end
package.preload.os = function()
  local mod = {}
  for name, f in pairs(os_funcs) do mod[name] = f end
  return mod
end
actionParams = {}
"""


def argo_runtime(lua: ModuleType = lua51) -> Any:
    """A LuaRuntime of lupa's ``lua`` module holding only what Argo CD gives a health script."""
    runtime = lua.LuaRuntime(register_eval=False, register_builtins=False)

    def as_set(names: frozenset[str]) -> Any:
        return runtime.table_from({name: True for name in names})

    keep_package = PACKAGE_FIELDS | {"searchers"}  # Lua 5.2+'s name for package.loaders
    runtime.execute(_RESTRICT, as_set(ARGO_GLOBALS - {"obj"}), as_set(TABLE_FUNCTIONS), as_set(keep_package),
                    as_set(SAFE_OS_FUNCTIONS))
    return runtime


def to_lua(runtime: Any, value: Any) -> Any:
    """JSON → Lua the way Argo CD's decodeValue (util/lua/lua.go) converts an object: objects and
    arrays become tables (arrays 1-based), null becomes nil (absent)."""
    if isinstance(value, dict):
        return runtime.table_from({k: to_lua(runtime, v) for k, v in value.items() if v is not None})
    if isinstance(value, list):
        return runtime.table_from([to_lua(runtime, v) for v in value])
    return value


def run_health(script: str, obj: dict[str, Any], lua: ModuleType = lua51) -> tuple[str, str]:
    """Run a health script against ``obj`` as Argo CD does; a Lua error raises ``LuaError`` (Argo
    CD shows the resource as Unknown with that error)."""
    runtime = argo_runtime(lua)
    runtime.globals().obj = to_lua(runtime, obj)
    hs = runtime.execute(script)
    assert hs is not None, "the script must return hs"
    return hs["status"], hs["message"]


# ------------------------------------------------------------------ names a script uses, from its bytecode

_GETGLOBAL, _SETGLOBAL, _SELF = 5, 7, 11  # Lua 5.1 lopcodes.h
_BITRK = 1 << 8  # an RK operand with this bit names a constant


@dataclass(frozen=True)
class ChunkNames:
    """The global names a Lua 5.1 chunk reads and writes, and the constant method names it calls
    (``x:name(...)``), in every function of it, whether or not a run reaches them."""

    reads: frozenset[str]
    writes: frozenset[str]
    methods: frozenset[str]


@dataclass
class _Dump:
    data: bytes
    pos: int = 12
    names: dict[int, set[str]] = field(default_factory=lambda: {_GETGLOBAL: set(), _SETGLOBAL: set(), _SELF: set()})

    def __post_init__(self) -> None:
        assert self.data[:6] == b"\x1bLua\x51\x00", "not a Lua 5.1 bytecode dump"
        self.order = "little" if self.data[6] == 1 else "big"
        self.size_int, self.size_t, self.size_instruction, self.size_number = self.data[7:11]
        self.integral = self.data[11] == 1

    def take(self, n: int) -> bytes:
        chunk = self.data[self.pos:self.pos + n]
        self.pos += n
        return chunk

    def int(self, size: int | None = None) -> int:
        return int.from_bytes(self.take(size or self.size_int), self.order)

    def string(self) -> str | None:
        n = self.int(self.size_t)
        return self.take(n)[:-1].decode() if n else None  # stored with its trailing NUL

    def number(self) -> float:
        raw = self.take(self.size_number)
        if self.integral:
            return int.from_bytes(raw, self.order, signed=True)
        return struct.unpack(("<" if self.order == "little" else ">") + ("d" if self.size_number == 8 else "f"), raw)[0]

    def constant(self) -> Any:
        kind = self.take(1)[0]
        if kind == 0:
            return None
        if kind == 1:
            return bool(self.take(1)[0])
        if kind == 3:
            return self.number()
        if kind == 4:
            return self.string()
        raise ValueError(f"unknown constant type {kind}")

    def function(self) -> None:
        """One function prototype, in ldump.c's order: header, code, constants, prototypes, debug."""
        self.string()  # source
        self.take(2 * self.size_int + 4)  # linedefined, lastlinedefined; nups, numparams, is_vararg, maxstacksize
        code = [self.int(self.size_instruction) for _ in range(self.int())]
        constants = [self.constant() for _ in range(self.int())]
        for instruction in code:
            op = instruction & 0x3F
            if op in (_GETGLOBAL, _SETGLOBAL):
                self.names[op].add(constants[instruction >> 14])
            elif op == _SELF and (c := (instruction >> 14) & 0x1FF) & _BITRK:
                self.names[_SELF].add(constants[c & ~_BITRK])
        for _ in range(self.int()):
            self.function()
        self.take(self.int() * self.size_int)  # line info
        for _ in range(self.int()):  # local variables: name, startpc, endpc
            self.string()
            self.take(2 * self.size_int)
        for _ in range(self.int()):  # upvalue names
            self.string()


def chunk_names(script: str) -> ChunkNames:
    """What ``script`` reads and calls by name, from its Lua 5.1 bytecode (``string.dump``)."""
    runtime = lua51.LuaRuntime(encoding=None, register_eval=False, register_builtins=False)
    dump = runtime.eval("function(source) return string.dump(assert(loadstring(source, '=script'))) end")
    parsed = _Dump(dump(script.encode()))
    parsed.function()
    assert parsed.pos == len(parsed.data), "bytecode left over: the dump was not read as Lua 5.1's format"
    return ChunkNames(frozenset(parsed.names[_GETGLOBAL]), frozenset(parsed.names[_SETGLOBAL]),
                      frozenset(parsed.names[_SELF]))
