"""Domain XML: the validated request, the policy that turns it into a DomainSpec (placement, pages,
MMIO window), rendering and schema validation."""
