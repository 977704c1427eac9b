"""The moving average of the weights (``training.ema_decay``): its update rule and warm-up,
integer buffers, and the swap that validation scores the averaged weights with. Its resume
through a real checkpoint is tested in ``test_resume_workers.py``."""

from __future__ import annotations

import pytest
import torch

from torchtitan.optimizer import WeightAverage


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))


def test_the_average_follows_the_rule_with_its_warm_up():
    torch.manual_seed(0)
    net = _Net()
    ema = WeightAverage(net, 0.9)
    expected = {k: v.detach().clone() for k, v in net.state_dict().items()}
    for n in range(30):
        with torch.no_grad():  # an optimizer step, in place
            net.lin.weight.add_(torch.randn(2, 3))
            net.lin.bias.mul_(1.5)
            net.count += 1
        d = min(0.9, (1 + n) / (10 + n))
        assert ema.decay_now() == pytest.approx(d)
        ema.update()
        for k, v in net.state_dict().items():
            expected[k] = v.clone() if not v.is_floating_point() else \
                expected[k] + (1 - d) * (v - expected[k])
    for k, v in ema.state_dict().items():
        torch.testing.assert_close(v, expected[k], rtol=1e-6, atol=1e-6)
    assert int(ema.state_dict()["count"]) == 30  # integer buffers are copied
    assert ema.updates == 30
    # Averaged, it is not the weights.
    assert not torch.equal(ema.state_dict()["lin.weight"], net.lin.weight)


def test_the_swap_puts_the_averages_in_and_the_weights_back():
    net = _Net()
    ema = WeightAverage(net, 0.5)
    with torch.no_grad():
        net.lin.weight.fill_(2.0)
    ema.update()  # warm-up decay 0.1: the average moves 90 % of the way
    trained = net.lin.weight.detach().clone()
    averaged = ema.state_dict()["lin.weight"].clone()
    assert not torch.equal(trained, averaged)
    with ema.swapped_in():
        assert torch.equal(net.lin.weight, averaged)
        x = torch.ones(1, 3)
        torch.testing.assert_close(net.lin(x),
                                   x @ averaged.T + net.lin.bias)
    assert torch.equal(net.lin.weight, trained)
    with pytest.raises(RuntimeError), ema.swapped_in():  # put back even when the body fails
        raise RuntimeError("validation failed")
    assert torch.equal(net.lin.weight, trained)


def test_reset_and_load():
    net = _Net()
    ema = WeightAverage(net, 0.99)
    with torch.no_grad():
        net.lin.weight.fill_(3.0)
    ema.reset()
    assert torch.equal(ema.state_dict()["lin.weight"], net.lin.weight)
    other = {k: torch.zeros_like(v) for k, v in ema.state_dict().items()}
    ema.load_state_dict(other)
    assert float(ema.state_dict()["lin.weight"].abs().sum()) == 0.0


@pytest.mark.parametrize("decay", [0.0, 1.0, -0.5])
def test_a_decay_outside_the_open_interval_is_refused(decay):
    with pytest.raises(ValueError, match="ema_decay"):
        WeightAverage(_Net(), decay)
