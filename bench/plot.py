"""Bar charts for the benchmarks, drawn with gnuplot (a Debian package; no Python plotting stack)."""
import os
import shutil
import subprocess


def bars(path, title, ylabel, categories, series, fmt="%.0f"):
    """Clustered bars: one cluster per category, one bar per series (name -> values, same order).

    Writes PATH (PNG) and PATH with .dat beside it (the numbers, so the plot can be redrawn).
    Returns False with a message when gnuplot is missing, instead of failing the benchmark.
    """
    if not shutil.which("gnuplot"):
        print(f"gnuplot not found: {path} not drawn (install gnuplot-nox)")
        return False
    data = os.path.splitext(path)[0] + ".dat"
    names = list(series)
    with open(data, "w") as f:
        f.write("category " + " ".join(f'"{n}"' for n in names) + "\n")
        for i, c in enumerate(categories):
            f.write(f'"{c}" ' + " ".join(f"{series[n][i]:.6g}" for n in names) + "\n")
    n = len(names)
    width = 0.8 / n
    plots = []
    for k, name in enumerate(names):
        off = (k - (n - 1) / 2) * width
        plots.append(f"'{data}' using ($0+{off:.4f}):{k + 2}:({width:.4f}) with boxes title '{name}'")
        plots.append(f"'{data}' using ($0+{off:.4f}):{k + 2}:(sprintf('{fmt}',${k + 2})) with labels offset 0,0.7 font ',8' notitle")
    script = f"""set terminal pngcairo size 1000,560
set output '{path}'
set title '{title}'
set style fill solid 0.7 border -1
set ylabel '{ylabel}'
set yrange [0:*]
set offsets 0.5, 0.5, graph 0.12, 0
set grid ytics
set rmargin 10
set bmargin 6
set key top left autotitle columnhead
set xtics rotate by -35 ({", ".join(f'"{c}" {i}' for i, c in enumerate(categories))})
plot {", ".join(plots)}
"""
    return _gnuplot(path, script)


def lines(path, title, xlabel, ylabel, curves, yrange=None):
    """One line per curve (name -> [(x, y), ...]). Writes PATH (PNG) and the numbers beside it (.dat)."""
    if not shutil.which("gnuplot"):
        print(f"gnuplot not found: {path} not drawn (install gnuplot-nox)")
        return False
    data = os.path.splitext(path)[0] + ".dat"
    names = list(curves)
    with open(data, "w") as f:
        for n in names:
            f.write(f'"{n}"\n')
            for x, y in curves[n]:
                f.write(f"{x:.6g} {y:.6g}\n")
            f.write("\n\n")
    plots = [f"'{data}' index {i} using 1:2 with linespoints title '{n}'" for i, n in enumerate(names)]
    script = f"""set terminal pngcairo size 1000,560
set output '{path}'
set title '{title}'
set xlabel '{xlabel}'
set ylabel '{ylabel}'
set grid
set key top right
{f"set yrange [{yrange[0]}:{yrange[1]}]" if yrange else ""}
plot {", ".join(plots)}
"""
    return _gnuplot(path, script)


def _gnuplot(path, script):
    r = subprocess.run(["gnuplot"], input=script, text=True, capture_output=True)
    if r.returncode != 0:
        print(f"gnuplot failed for {path}: {r.stderr.strip()[:500]}")
        return False
    return True
