"""The one adapter to other libraries' private APIs (the lowest layer: imports no jaxmoe
package but errors), so an upgrade that moves one breaks one file and its test."""
