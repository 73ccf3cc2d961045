import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuvfio.address import PciAddress
from gpuvfio.errors import InputError
from gpuvfio.selector import Selector

addresses = st.builds(PciAddress, st.integers(0, 0xFFFFFFFF), st.integers(0, 0xFF),
                      st.integers(0, 0x1F), st.integers(0, 7))


@given(addresses)
def test_format_parse_roundtrip(addr):
    assert PciAddress.parse(str(addr)) == addr
    assert PciAddress.parse(str(addr).upper()) == addr


@given(addresses, addresses)
def test_order_is_numeric(a, b):
    assert (a < b) == ((a.domain, a.bus, a.slot, a.function) < (b.domain, b.bus, b.slot, b.function))


@given(st.integers(0x20, 0xFF))
def test_slot_above_1f_rejected(slot):
    with pytest.raises(InputError):
        PciAddress.parse(f"0000:01:{slot:02x}.0")


@given(st.text(max_size=30))
def test_arbitrary_text_never_crashes(text):
    try:
        addr = PciAddress.parse(text)
    except InputError:
        return
    assert PciAddress.parse(str(addr)) == addr


def test_vmd_domain_and_short_form():
    assert str(PciAddress.parse("10000:e1:00.0")) == "10000:e1:00.0"
    assert str(PciAddress.parse("1:0.0")) == "0000:01:00.0"
    assert PciAddress.parse("0000:01:00.1").device == (0, 1, 0)


@pytest.mark.parametrize("bad", ["", "0000:01:00", "0000:01:00.8", "000:01:00.0", "0000:100:00.0",
                                 "../0000:01:00.0", "0000:01:00.0/..", "0000:01:00.0 x", "0x01:00.0"])
def test_malformed(bad):
    with pytest.raises(InputError):
        PciAddress.parse(bad)


@pytest.mark.parametrize("text, function", [("0000:01:00.8", "8"), ("01:00.9", "9"), ("01:00.a", "a"),
                                            ("01:00.10", "10")])
def test_a_function_beyond_7_is_named_in_the_refusal(text, function):
    for parse in (PciAddress.parse, Selector.parse):
        with pytest.raises(InputError, match=rf"^not a PCI address: '{text}' \(a PCI function is 0-7, "
                                             rf"not {function}\) \(expected "):
            parse(text)
    with pytest.raises(InputError, match=r"\(a PCI function is 0-7, not 9\)"):
        Selector.parse("pci_0000_01_00_9")


@pytest.mark.parametrize("text", ["01:00.x", "0000:01:00.0.9", "01:00.9\nx", "01:00.-1", "01:00.9999", "1:00:00.9"])
def test_other_faults_get_no_function_hint(text):
    for parse in (PciAddress.parse, Selector.parse):
        with pytest.raises(InputError) as info:
            parse(text)
        assert "a PCI function is" not in str(info.value)
