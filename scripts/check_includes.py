#!/usr/bin/env python3
"""Checks the include graph of the tree: no cycle between modules (folders),
no cycle between files, the library (src/) never includes engine/, server/,
cli/, bench/ or tools/, and engine/, server/, tools/replay/ and cli/ include
no private header of the library (src/). Prints what it finds; exit 0 when
clean, 1 otherwise. Usage: check_includes.py [SOURCE_DIR]"""
import os
import re
import sys

root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), '..'))
folders = ['include/kvtier', 'include/kvtier/experimental', 'src/base', 'src/cache', 'src/ram', 'src/tier',
           'src/ssd', 'src/service', 'src/remote', 'src/publish', 'src/io', 'src', 'engine', 'server',
           'cli', 'bench', 'tools/replay']
files = {}
for dirpath, _, names in os.walk(root):
    rel = os.path.relpath(dirpath, root)
    if rel.startswith(('build', '.git', 'tests', 'fuzz', 'examples')) or '/node_modules' in rel:
        continue
    for n in names:
        if n.endswith(('.c', '.h')):
            files[os.path.normpath(os.path.join(rel, n))] = None

def module(path):
    d = os.path.dirname(path)
    return d if d in folders else None

src_dirs = [f for f in folders if f.startswith('src')]
search = {  # where a quoted include is looked up, after the including file's own folder
    'src': ['include'] + src_dirs,
    'engine': ['include', 'engine'],
    'server': ['include', 'server', 'engine'],
    'tools/replay': ['include', 'tools/replay', 'engine'],
    'cli': ['include', 'cli', 'bench', 'server', 'engine', 'tools/replay'],
    'bench': ['include', 'cli', 'bench', 'server', 'engine', 'tools/replay'],
    'include': ['include'],
}
inc_re = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
graph = {}
for f in files:
    m = module(f)
    if m is None:
        continue
    top = 'src' if m.startswith('src') else 'include' if m.startswith('include') else m
    text = open(os.path.join(root, f), encoding='utf-8', errors='replace').read()
    deps = []
    for name in inc_re.findall(text):
        for d in [os.path.dirname(f)] + search[top]:
            cand = os.path.normpath(os.path.join(d, name))
            if cand in files:
                deps.append(cand)
                break
    graph[f] = deps

bad = 0
def cycles(g):
    out, state, stack = [], {}, []
    def visit(n):
        state[n] = 1
        stack.append(n)
        for d in g.get(n, ()):
            if state.get(d) == 1:
                out.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d)
        stack.pop()
        state[n] = 2
    for n in sorted(g):
        if n not in state:
            visit(n)
    return out

for c in cycles(graph):
    print('file include cycle: ' + ' -> '.join(c))
    bad = 1
mg = {}
for f, deps in graph.items():
    if f == 'include/kvtier/kvtier.h':
        continue  # the umbrella includes every module, the experimental ones too
    for d in deps:
        a, b = module(f), module(d)
        if a != b:
            mg.setdefault(a, set()).add(b)
for c in cycles({k: sorted(v) for k, v in mg.items()}):
    print('module include cycle: ' + ' -> '.join(c))
    bad = 1
for f, deps in sorted(graph.items()):
    m = module(f)
    for d in deps:
        dm = module(d)
        if m.startswith('src') and not (dm.startswith('src') or dm.startswith('include')):
            print(f'library file {f} includes {d}')
            bad = 1
        if not m.startswith(('src', 'include')) and dm.startswith('src'):
            print(f'{f} includes the private library header {d}')
            bad = 1
        if m.startswith('include') and not dm.startswith('include'):
            print(f'public header {f} includes {d}')
            bad = 1
print('module include graph:')
for a in sorted(mg):
    print(f'  {a} -> {", ".join(sorted(mg[a]))}')
print('ok: no include cycle, layers respected' if not bad else 'FAIL')
sys.exit(bad)
