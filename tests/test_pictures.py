"""pictures: a headless figure written where it is asked for, then closed."""

from jaxmoral import pictures


def test_save_figure_writes_a_png_in_a_new_folder_and_closes_the_figure(tmp_path):
  plt = pictures.pyplot()
  assert plt.get_backend().lower() == "agg"
  fig, ax = plt.subplots()
  ax.plot([0, 1], [1, 0])
  path = tmp_path / "new" / "deeper" / "curve.png"
  assert pictures.save_figure(fig, path, dpi=50) == str(path)
  assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert fig.number not in plt.get_fignums()
