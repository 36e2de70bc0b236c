"""The acceptance model: request features → per-subset acceptance survival, a linear model.

Shape legend: R training requests, F features, P principal components, C = M * D outputs (M SSM
subsets, D label depth).

Full-information labels give, per request, every subset's survival curve directly (the share of
steps that subset's merged tree accepted ≥ d tokens, ``subsets.union_survival``), so we regress
those instead of combining per-SSM predictions under an independence assumption the SSMs break
(boost-tuned SSMs fail together on hard tokens). The model is scikit-learn's
``StandardScaler → PCA → Ridge`` (one ridge per output): few requests, many correlated features.
The first ``passthrough`` features (the spec's few scalars: prompt length, chat, prompt-lookup hit
rate) go to the ridge as they are, next to the principal components of the rest: folded into a
PCA of hundreds of hidden-state dimensions, one informative scalar would be lost.
The number of components and the penalty are chosen by K-fold cross-validation of the whole
pipeline (PCA refitted per fold: with far more features than requests, a PCA fitted on the
held-out request too would make every fit look good); when nothing generalises, the largest
penalty wins and the predictions shrink to the training mean, i.e. the best fixed choice. Its
parameters are plain arrays, so serving evaluates it in numpy from JSON (``LinearModel.predict``
equals the fitted pipeline's ``predict``); no pickle.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LinearModel:
    """``z = (x - x_mean) / x_scale``; ``y = [z[:k], (z[k:] - pca_mean) @ components.T] @ coef.T + intercept``.

    Attributes:
        x_mean: (F,) feature means.
        x_scale: (F,) feature standard deviations (1 where a feature is constant).
        pca_mean: (F - k,) mean of the standardized features the PCA sees (≈ 0).
        components: (P, F - k) principal axes.
        pca_std: (P,) standard deviation of the training requests along each axis.
        coef: (C, k + P) ridge coefficients.
        intercept: (C,) ridge intercepts.
        alpha: the ridge penalty cross-validation chose.
        passthrough: k, leading features fed to the ridge without the PCA.
    """

    x_mean: np.ndarray
    x_scale: np.ndarray
    pca_mean: np.ndarray
    components: np.ndarray
    pca_std: np.ndarray
    coef: np.ndarray
    intercept: np.ndarray
    alpha: float
    passthrough: int = 0

    def __post_init__(self) -> None:
        f, p, c = self.x_mean.shape[0], self.components.shape[0], self.intercept.shape[0]
        k = self.passthrough
        if not 0 <= k < f:
            raise ValueError(f"linear model: passthrough must be in [0, {f}), got {k}")
        shapes = {
            "x_scale": (self.x_scale.shape, (f,)),
            "pca_mean": (self.pca_mean.shape, (f - k,)),
            "components": (self.components.shape, (p, f - k)),
            "pca_std": (self.pca_std.shape, (p,)),
            "coef": (self.coef.shape, (c, k + p)),
        }
        for name, (got, want) in shapes.items():
            if got != want:
                raise ValueError(f"linear model: {name} has shape {got}, expected {want}")
        arrays = (
            self.x_mean,
            self.x_scale,
            self.pca_mean,
            self.components,
            self.pca_std,
            self.coef,
            self.intercept,
        )
        if not all(np.isfinite(a).all() for a in arrays) or not (self.x_scale > 0).all():
            raise ValueError("linear model: parameters must be finite, x_scale positive")

    @property
    def n_features(self) -> int:
        return int(self.x_mean.shape[0])

    def project(self, x: np.ndarray) -> np.ndarray:
        """(F,) or (R, F) features → (k + P,) or (R, k + P): passed-through features, principal coordinates."""
        z = (x - self.x_mean) / self.x_scale
        k = self.passthrough
        return np.concatenate([z[..., :k], (z[..., k:] - self.pca_mean) @ self.components.T], axis=-1)

    def predict(self, x: np.ndarray) -> np.ndarray:
        """(F,) or (R, F) features → (C,) or (R, C) outputs."""
        return self.project(x) @ self.coef.T + self.intercept

    def distance(self, x: np.ndarray) -> float:
        """Largest |coordinate| of ``x`` (passed-through features and principal axes), in training
        standard deviations (the passed-through ones are standardized: 1)."""
        z = self.project(x)
        std = np.concatenate([np.ones(self.passthrough), self.pca_std])
        live = std > 1e-12
        return float(np.max(np.abs(z[..., live] / std[live]), initial=0.0))

    def to_json(self) -> dict:
        return {
            "type": "linear_model",
            "x_mean": self.x_mean.tolist(),
            "x_scale": self.x_scale.tolist(),
            "pca_mean": self.pca_mean.tolist(),
            "components": self.components.tolist(),
            "pca_std": self.pca_std.tolist(),
            "coef": self.coef.tolist(),
            "intercept": self.intercept.tolist(),
            "alpha": self.alpha,
            "passthrough": self.passthrough,
        }

    @classmethod
    def from_json(cls, obj: dict) -> LinearModel:
        def arr(name: str, ndim: int) -> np.ndarray:
            a = np.asarray(obj[name], dtype=np.float64)
            if a.ndim != ndim:
                raise ValueError(f"linear model: {name} must be {ndim}-D, got {a.ndim}-D")
            return a

        return cls(
            x_mean=arr("x_mean", 1),
            x_scale=arr("x_scale", 1),
            pca_mean=arr("pca_mean", 1),
            components=arr("components", 2),
            pca_std=arr("pca_std", 1),
            coef=arr("coef", 2),
            intercept=arr("intercept", 1),
            alpha=float(obj["alpha"]),
            passthrough=int(obj.get("passthrough", 0)),  # absent in files written before it existed
        )


CV_FOLDS = 5
MIN_FIT_REQUESTS = 3  # the fewest requests the acceptance model is fitted on


def make_pipeline(components: int, alpha: float, n_features: int, passthrough: int = 0):
    """The scikit-learn pipeline whose parameters ``LinearModel`` carries."""
    from sklearn.compose import ColumnTransformer
    from sklearn.decomposition import PCA
    from sklearn.linear_model import Ridge
    from sklearn.pipeline import Pipeline
    from sklearn.preprocessing import StandardScaler

    # column slices, not index lists: sklearn checks a list's every entry on every fit and transform
    parts = [("keep", "passthrough", slice(0, passthrough))] if passthrough else []
    parts.append(("pca", PCA(n_components=components, svd_solver="full"), slice(passthrough, n_features)))
    return Pipeline(
        [
            ("scale", StandardScaler()),
            ("features", ColumnTransformer(parts)),
            ("ridge", Ridge(alpha=alpha)),
        ]
    )


def component_grid(n_requests: int, n_features: int, components: int, folds: int) -> list[int]:
    """1, 2, 4, ... up to ``components``, capped by what the smallest CV training fold supports."""
    smallest_fold = n_requests - -(-n_requests // folds)
    cap = max(1, min(components, smallest_fold - 1, n_features))
    grid = [c for c in (1, 2, 4, 8, 16, 32, 64) if c < cap]
    return grid + [cap]


def fit_linear(
    x: np.ndarray, y: np.ndarray, components: int, alphas: Sequence[float], passthrough: int = 0
) -> LinearModel:
    """Fit (R, F) features to (R, C) targets, choosing components and penalty by K-fold CV; the
    first ``passthrough`` features skip the PCA."""
    from sklearn.model_selection import GridSearchCV, KFold

    r, f = x.shape
    if r < MIN_FIT_REQUESTS:
        raise ValueError(f"the scheduler needs at least {MIN_FIT_REQUESTS} training requests, got {r}; raise scheduler.limit")
    if y.shape[0] != r:
        raise ValueError(f"features have {r} rows but targets {y.shape[0]}")
    folds = min(CV_FOLDS, r)
    grid = {
        "features__pca__n_components": component_grid(r, f - passthrough, components, folds),
        "ridge__alpha": [float(a) for a in alphas],
    }
    search = GridSearchCV(
        make_pipeline(1, 1.0, f, passthrough),
        grid,
        cv=KFold(folds, shuffle=True, random_state=0),
        scoring="neg_mean_squared_error",
    )
    pipe = search.fit(x, y).best_estimator_
    scale, ridge = pipe.named_steps["scale"], pipe.named_steps["ridge"]
    pca = pipe.named_steps["features"].named_transformers_["pca"]
    coef = np.atleast_2d(ridge.coef_)
    return LinearModel(
        x_mean=scale.mean_.astype(np.float64),
        x_scale=scale.scale_.astype(np.float64),
        pca_mean=pca.mean_.astype(np.float64),
        components=pca.components_.astype(np.float64),
        pca_std=np.sqrt(np.maximum(pca.explained_variance_, 0.0)),
        coef=coef.astype(np.float64),
        intercept=np.atleast_1d(ridge.intercept_).astype(np.float64),
        alpha=float(ridge.alpha),
        passthrough=passthrough,
    )
