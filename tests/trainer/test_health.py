"""trainer/runtime/health.py's pictures: validation grids labelled with their prompts and seeds, a loss curve with ticks."""

from pathlib import Path
from types import SimpleNamespace

from PIL import Image

from trainer.report.render import log_ticks, nice_ticks
from trainer.runtime.health import draw_loss_curve, grid_layout, validation_grid

PROMPTS, SEEDS = ["a red dog", "a blue cat on a long wall"], [0, 7, 42]


class FakePipeline:
    """Stands in for a diffusers pipeline: one flat, light picture per prompt, coloured by its place."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def set_progress_bar_config(self, **_: object) -> None:
        pass

    def __call__(self, prompts: list[str], **kwargs) -> SimpleNamespace:
        self.calls.append({"prompts": prompts, **kwargs})
        return SimpleNamespace(images=[Image.new("RGB", (kwargs["width"], kwargs["height"]), (250, 200 - 20 * n, 150))
                                       for n in range(len(prompts))])


def dark(picture: Image.Image, box: tuple[int, int, int, int], below: int = 100) -> int:
    """How many pixels of `box` are darker than `below`: text, on the picture's white."""
    return picture.crop(box).convert("L").point(lambda v: v < below and 255).histogram()[255]


def runs(flags: list[bool], join: int = 6) -> int:
    """How many groups of set flags there are, groups less than `join` apart counted as one."""
    count, gap = 0, join
    for flag in flags:
        if flag:
            count, gap = count + (gap >= join), 0
        else:
            gap += 1
    return count


def test_a_validation_grid_labels_each_row_with_its_prompt_and_each_column_with_its_seed() -> None:
    pipeline = FakePipeline()

    grid = validation_grid(pipeline, PROMPTS, SEEDS, resolution=64, steps=2)

    layout = grid_layout(64, len(PROMPTS), len(SEEDS))
    assert grid.size == layout.size and layout.tile == 128  # 64 px samples drawn twice as big
    assert pipeline.calls[0]["prompts"] == [p for p in PROMPTS for _ in SEEDS]
    for row in range(len(PROMPTS)):  # the prompt, written beside its row
        _, top = layout.corner(row, 0)
        assert dark(grid, (0, top, layout.label_width, top + layout.tile)) > 150
    for column in range(len(SEEDS)):  # the seed, written over its column
        left, _ = layout.corner(0, column)
        assert dark(grid, (left, 0, left + layout.tile, layout.header)) > 60


class Returning(FakePipeline):
    """A pipeline that returns the pictures it is given."""

    def __init__(self, images: list[Image.Image]) -> None:
        super().__init__()
        self.images = images

    def __call__(self, prompts: list[str], **kwargs) -> SimpleNamespace:
        return SimpleNamespace(images=self.images)


def test_a_small_sample_is_zoomed_by_whole_pixels_so_it_stays_sharp() -> None:
    sample = Image.frombytes("RGB", (32, 32), bytes(range(256)) * 12)

    grid = validation_grid(Returning([sample] * 6), PROMPTS, SEEDS, resolution=32, steps=2)

    layout = grid_layout(32, len(PROMPTS), len(SEEDS))
    left, top = layout.corner(1, 2)
    shown = grid.crop((left, top, left + layout.tile, top + layout.tile))
    assert layout.tile == 128 and shown.resize((32, 32), Image.Resampling.NEAREST).tobytes() == sample.tobytes()
    assert sorted(shown.getcolors(1 << 16), key=lambda c: c[1]) == sorted(
        ((n * 16, colour) for n, colour in sample.getcolors(1 << 16)), key=lambda c: c[1])  # each pixel 4x4, no blur


def test_a_long_prompt_is_wrapped_and_cut_within_its_own_row() -> None:
    prompts = ["a very long prompt " * 20, ""]

    grid = validation_grid(FakePipeline(), prompts, SEEDS[:1], resolution=64, steps=2)

    layout = grid_layout(64, 2, 1)
    (_, first), (_, second) = layout.corner(0, 0), layout.corner(1, 0)
    assert dark(grid, (0, first, layout.label_width, first + layout.tile)) > 1000  # several lines of it
    assert dark(grid, (0, first + layout.tile, layout.label_width, grid.height)) == 0  # nothing spills into the next row
    assert dark(grid, (layout.label_width - 8, first, layout.label_width, second)) == 0  # nor into the tiles


def test_the_loss_curve_has_a_labelled_tick_per_round_value_on_both_axes(tmp_path: Path) -> None:
    history = [(step, 2.0 * 0.995 ** step) for step in range(10, 1001, 10)]

    draw_loss_curve(history, tmp_path / "loss.png")

    picture = Image.open(tmp_path / "loss.png").convert("L")
    assert picture.size == (800, 400)
    losses = [loss for _, loss in history]
    left_labels = [any(picture.getpixel((x, y)) < 100 for x in range(30, 74)) for y in range(30, 350)]
    under_labels = [any(picture.getpixel((x, y)) < 100 for y in range(350, 366)) for x in range(60, 800)]
    assert runs(left_labels) == len(log_ticks(min(losses), max(losses))) == 8  # 0.01, 0.02, 0.05, 0.1, ..., 2
    assert runs(under_labels) == len(nice_ticks(10, 1000, 8, integer=True)) == 6  # 0, 200, ..., 1000
    assert dark(picture.convert("RGB"), (0, 150, 24, 250)) > 20  # the loss axis's title, written upwards
    assert dark(picture.convert("RGB"), (380, 375, 430, 400)) > 20  # the step axis's title


def test_a_loss_curve_without_a_finite_loss_says_so_and_has_no_ticks(tmp_path: Path) -> None:
    draw_loss_curve([(1, float("nan")), (2, None)], tmp_path / "loss.png")

    picture = Image.open(tmp_path / "loss.png").convert("RGB")
    assert dark(picture, (30, 30, 74, 340)) == 0 and dark(picture, (60, 350, 800, 366)) == 0
    assert dark(picture, (300, 180, 500, 220), below=200) > 100  # "no finite loss logged yet", in grey
